"""Tensor parallelism: which part of a model one rank holds, and the collectives that join them.

Megatron's split, as sglang and vLLM make it: q/k/v and gate/up are column-parallel (each rank
computes its heads and its share of the intermediate size), o and down are row-parallel (each
rank's partial sum, then one all-reduce), the embedding and the lm_head are split by vocab rows
(an all-reduce for the embedding, where one rank has each token's row and the others add zeros,
so the sum is exact; an all-gather for the logits). Every rank holds the KV of its own KV heads
(a KV head is copied on several ranks when there are fewer KV heads than ranks), in pages whose
indexes mean the same slots on every rank: one scheduler decides for all.

`TensorParallel(0, 1)` is one rank alone: every collective is the identity, no
torch.distributed. With more ranks the collectives run over the default process group (gloo on
the CPU, nccl on CUDA), which runtime/scheduler/ranks.py starts. Importing this needs no torch
(the HTTP process checks a split before it starts anything).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.model_config import ModelConfig

if TYPE_CHECKING:
    import torch


class TPConfigError(ValueError):
    """A model that this TP size cannot split (a head count it does not divide)."""


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def check(self, config: ModelConfig) -> None:
        """Refuse a split that cannot work, naming the counts."""
        tp, heads, kv = self.size, config.num_heads, config.num_kv_heads
        if tp < 1:
            raise TPConfigError(f"--tp must be at least 1, got {tp}")
        problems = []
        if heads % tp:
            problems.append(f"{heads} attention heads")
        if kv % tp and tp % kv:
            problems.append(f"{kv} KV heads (nor does {kv} divide {tp})")
        if config.intermediate_size % tp:
            problems.append(f"an intermediate size of {config.intermediate_size}")
        if config.moe is not None and config.moe.intermediate_size % tp:
            problems.append(f"an expert intermediate size of {config.moe.intermediate_size}")
        if problems:
            raise TPConfigError(f"--tp {tp} does not divide the model's {' or '.join(problems)} "
                                f"({config.architecture})")

    # ---- what this rank holds ----------------------------------------------------------------
    def part(self, n: int) -> tuple[int, int]:
        """[start, stop) of this rank's equal share of n (n divisible by the size)."""
        share = n // self.size
        return self.rank * share, (self.rank + 1) * share

    def heads(self, config: ModelConfig) -> tuple[int, int]:
        """This rank's query heads."""
        return self.part(config.num_heads)

    def kv_heads(self, config: ModelConfig) -> tuple[int, int]:
        """This rank's KV heads: an equal share, or the one head its query heads read when
        there are fewer KV heads than ranks (copied on size / KV heads ranks)."""
        kv = config.num_kv_heads
        if kv >= self.size:
            return self.part(kv)
        head = self.rank * kv // self.size
        return head, head + 1

    def kv_split(self, config: ModelConfig) -> tuple[tuple[int, int], ...]:
        """Every rank's KV heads, in rank order (the KV canary sums a slot over them)."""
        return tuple(TensorParallel(r, self.size).kv_heads(config) for r in range(self.size))

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """This rank's rows of the embedding and lm_head: ceil(V / size) each, the last fewer."""
        share = -(-vocab_size // self.size)
        return min(self.rank * share, vocab_size), min((self.rank + 1) * share, vocab_size)

    # ---- collectives -------------------------------------------------------------------------
    @property
    def graph_safe(self) -> bool:
        """Whether a CUDA graph can capture the collectives: one rank (none), or nccl (its
        all-reduce and all-gather run on the capturing stream and replay from the graph);
        gloo runs on the host and cannot."""
        if self.size == 1:
            return True
        import torch.distributed as dist

        return bool(dist.get_backend() == "nccl")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (in place)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x)
        return x

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        """The largest of every rank's x, elementwise (in place)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's logits [R, its vocab rows] side by side: [R, vocab_size], the same on
        every rank (so every rank samples the same tokens)."""
        if self.size == 1:
            return logits
        import torch
        import torch.distributed as dist

        share = -(-vocab_size // self.size)
        if logits.shape[-1] < share:  # the last rank's share is short: pad, then cut
            logits = torch.nn.functional.pad(logits, (0, share - logits.shape[-1]))
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    def min_int(self, n: int) -> int:
        """The smallest of every rank's n (ranks size their KV pools alike)."""
        if self.size == 1:
            return n
        import torch
        import torch.distributed as dist

        t = torch.tensor([n], dtype=torch.int64,
                         device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())
