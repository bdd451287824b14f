"""A sampler backend plugin for tests: the torch sampler, plus each step's sampled ids mirrored
into customized_info["mirror"]. Loaded in the scheduler process by `--plugin`."""

from __future__ import annotations

from runtime.engine.sampler import SamplerOutput, TorchSampler, register_sampler_backend
from runtime.forward_batch import SamplingBatchInfo

BACKEND = "mirror"
FIELD = "mirror"


class MirrorSampler(TorchSampler):
    def sample(self, logits, info: SamplingBatchInfo) -> SamplerOutput:  # type: ignore[no-untyped-def]
        out = super().sample(logits, info)
        info_out = dict(out.customized_info or {})
        info_out[FIELD] = out.next_token_ids.detach().cpu().tolist()
        return SamplerOutput(out.next_token_ids, customized_info=info_out)


register_sampler_backend(BACKEND, MirrorSampler)
