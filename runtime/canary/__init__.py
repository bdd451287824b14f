"""Request identity and self-checks (seed 002; docs/kv-canary.md).

`identity`: a request's rid and bootstrap room as int64 tensors for the forward batch.
`oracle`: the token oracle, a token sequence fixed by (id, position) alone, so prefill and decode
produce the same tokens with no shared state and a PD run can be verified token by token.
The KV canary: `chain` (the tag of a token prefix), `slots` (the tags and checks next to the KV
pool), `kvsum` (byte checksums of slots), `guard` (the runner's hook), `monitor` (the
scheduler's side: what to check, what a violation means), `handoff` (across PD);
`perturb` and `perturb_kinds`: the fault injection that proves it catches what it should.
"""
