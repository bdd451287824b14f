"""`spec.<pool>.tensorParallelSize`: a pod per tensor-parallel group, and what a split may not be.

A pool of size N runs `baton serve --tp N`: N ranks in one pod (rank 0 schedules, ranks
1..N-1 follow it), one GPU each on a GPU pool, so N is the pool's GPU count and defaults to
it (else 1). What can never work is refused with the field named, before any pod starts (the
runtime refuses the same at start-up, exit code 2, which the operator reports as
ModelNotServable, but only once a pod has been scheduled and has loaded):

- N other than the GPU count on a GPU pool (a rank per GPU);
- N > NIXL_MAX_TP with nixl (`spec.kvTransfer.backend`, or `--kv-transfer` in the pool's
  args): each rank has a nixl agent of its own, and UCX's TCP port range in the pod
  (builders/common.py UCX_PORT_RANGE, admitted by the NetworkPolicy) holds two listeners each
  for 8 of them;
- `--tp` in the pool's args: the field says it, and sizes the GPUs, /dev/shm and KV ports;
- a builtin model (the only one whose shape the operator knows: it reads no checkpoint) that N
  does not split, by the runtime's rule (runtime/models/parallel.py `TensorParallel.check`).

One pod holds one group; a group across pods (multi-node) is not built: docs/tensor-parallel.md
says how a LeaderWorkerSet would fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from baton_operator.checks import InvalidSpec, integer
from baton_operator.model import ModelSource

MAX_TP = 64  # ranks in one pod; a pod rarely has more than 8 GPUs
NIXL_MAX_TP = 8  # ranks with a nixl agent each: UCX_PORT_RANGE's 16 ports, two per agent


@dataclass(frozen=True)
class ModelShape:
    """What decides whether a tensor-parallel size splits a model."""

    heads: int
    kv_heads: int
    intermediate_size: int
    architecture: str


# The builtin models' config.json (tests/operator/test_operator_parallel.py holds this to the
# prepared model's file and the rule to the runtime's).
BUILTIN_SHAPES = {
    "smollm2-135m": ModelShape(heads=9, kv_heads=3, intermediate_size=1536,
                               architecture="LlamaForCausalLM"),
}
TP_FLAGS = ("--tp", "--tensor-parallel-size")


def tensor_parallel_size(raw: object, gpus: int | None, where: str) -> int:
    """`<where>.tensorParallelSize`, defaulting to the pool's GPU count (`gpus`), else 1."""
    field = f"{where}.tensorParallelSize"
    tp = integer(gpus or 1 if raw is None else raw, field, minimum=1, maximum=MAX_TP)
    if gpus is not None and tp != gpus:
        raise InvalidSpec(
            f"{field} {tp} and the pool's {gpus} GPU(s) per pod ({where}.gpu.count or its "
            f"nvidia.com/gpu limit) disagree: a pod holds one TP group, one GPU per rank")
    return tp


def check_pool(where: str, tp: int, *, kv_backend: str, args: Sequence[str],
               model: ModelSource) -> None:
    """Refuse a pool whose TP size can never serve (see the module docstring)."""
    flags = _flags(args)
    for flag in TP_FLAGS:
        if flag in flags:
            raise InvalidSpec(f"{where}.args {flag}: set {where}.tensorParallelSize instead "
                              "(it also sizes the pod's GPUs, /dev/shm and KV ports)")
    if tp == 1:
        return
    field = f"{where}.tensorParallelSize {tp}"
    if flags.get("--kv-transfer", kv_backend) == "nixl" and tp > NIXL_MAX_TP:
        source = f"{where}.args" if "--kv-transfer" in flags else "spec.kvTransfer.backend"
        raise InvalidSpec(f"{field} with nixl ({source}): a pod's UCX port range holds the "
                          f"agents of {NIXL_MAX_TP} ranks; use the tcp KV transfer")
    shape = BUILTIN_SHAPES.get(model.location) if model.kind == "builtin" else None
    problem = None if shape is None else split_problem(shape, tp)
    if problem is not None:
        raise InvalidSpec(f"{field} does not divide {problem} ({model.uri})")


def split_problem(shape: ModelShape, tp: int) -> str | None:
    """What of the model `tp` does not divide, in the runtime's words; None when it splits."""
    problems = []
    if shape.heads % tp:
        problems.append(f"{shape.heads} attention heads")
    if shape.kv_heads % tp and tp % shape.kv_heads:
        problems.append(f"{shape.kv_heads} KV heads (nor does {shape.kv_heads} divide {tp})")
    if shape.intermediate_size % tp:
        problems.append(f"an intermediate size of {shape.intermediate_size}")
    if not problems:
        return None
    return f"the model's {' or '.join(problems)} ({shape.architecture})"


def _flags(args: Sequence[str]) -> dict[str, str]:
    """`--flag value` and `--flag=value` pairs of `baton serve` args; the last one wins, as in
    argparse (a flag without a value maps to "")."""
    out: dict[str, str] = {}
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg.partition("=")
        if not eq:
            after = args[i + 1] if i + 1 < len(args) else ""
            value = "" if after.startswith("--") else after
        out[name] = value
    return out
