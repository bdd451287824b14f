"""The fault kinds `--perturb` takes (runtime/canary/perturb.py injects them); torch-free, so
that argument parsing can check a spec without loading the runtime."""

from __future__ import annotations

KINDS = ("kv_after_forward", "req_to_token", "wrong_slots", "next_token_swap", "kv_before_send")
# what must be on, beyond --kv-canary, for the canary to catch a kind (docs/kv-canary.md)
BYTE_KINDS = ("kv_after_forward", "kv_before_send")  # byte checksums
ORACLE_KINDS = ("next_token_swap",)  # the token oracle sampler


def parse_perturb(spec: str | None) -> dict[str, float]:
    """'kind=prob,kind=prob' -> {kind: prob}; raises ValueError on a bad spec."""
    out: dict[str, float] = {}
    for item in filter(None, (spec or "").split(",")):
        kind, _, prob = item.partition("=")
        if kind not in KINDS:
            raise ValueError(f"--perturb: unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
        try:
            p = float(prob)
        except ValueError:
            raise ValueError(f"--perturb: {item!r} is not KIND=PROB") from None
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"--perturb: probability {p} of {kind} is not in [0, 1]")
        out[kind] = p
    return out


def uncatchable(kinds: dict[str, float], kv_canary_bytes: str, sampler_backend: str) -> list[str]:
    """Why each injected kind would go unseen under this configuration (none: all caught)."""
    problems = [f"--perturb {k} corrupts KV bytes, which only byte checksums catch: it needs "
                "--kv-canary-bytes partial or all" for k in kinds
                if k in BYTE_KINDS and kv_canary_bytes == "none"]
    problems += [f"--perturb {k} swaps sampled tokens, which only the token oracle catches: it "
                 "needs --sampler-backend token_oracle" for k in kinds
                 if k in ORACLE_KINDS and sampler_backend != "token_oracle"]
    return problems
