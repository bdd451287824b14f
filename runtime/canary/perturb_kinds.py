"""The fault kinds `--perturb` takes (runtime/canary/perturb.py injects them); torch-free, so
that argument parsing can check a spec without loading the runtime."""

from __future__ import annotations

KINDS = ("kv_after_forward", "req_to_token", "wrong_slots", "next_token_swap", "kv_before_send")


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
