"""Request identity and self-checks (seed 002).

`identity`: a request's rid and bootstrap room as int64 tensors for the forward batch.
`oracle`: the token oracle, a token sequence fixed by (id, position) alone, so prefill and decode
produce the same tokens with no shared state and a PD run can be verified token by token.
"""
