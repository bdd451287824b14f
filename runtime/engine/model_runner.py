"""ModelRunner: weights, KV pool, attention and sampler backends behind one call.

`forward_batch(batch) -> ForwardOutput` runs the model on the batch's new tokens, applies
penalties, samples, and computes logprobs when asked. It keeps no per-request state except the
penalty rows (see PenaltyState), so the scheduler can be tested against a fake runner.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from runtime.attention.registry import create_attention_backend
from runtime.canary.guard import build_guard
from runtime.canary.kvsum import HeadSplit
from runtime.config import CanaryConfig, EngineConfig
from runtime.device import bind_thread, serving_device
from runtime.engine.cuda_graph import DecodeGraphs, Graph
from runtime.engine.memory import kv_pages, out_of_memory
from runtime.engine.penalty import PenaltyState
from runtime.engine.sampler import TokenOracleSampler, create_sampler_backend
from runtime.forward_batch import ForwardBatch, ForwardOutput
from runtime.kvcache.allocator import PageAllocator
from runtime.kvcache.fp8 import FP8, KVScales, checkpoint_scales
from runtime.kvcache.manager import KVCacheManager
from runtime.kvcache.pool import KVPool, page_nbytes
from runtime.kvcache.radix import RadixCache
from runtime.kvcache.req_to_token import ReqToTokenPool
from runtime.model_config import ModelConfig
from runtime.model_store import resolve_model_path
from runtime.models.fp8_linear import fp8_gemms_run, quantize_fp8
from runtime.models.linear import use_onednn
from runtime.models.parallel import TensorParallel
from runtime.models.quantize import quantize
from runtime.models.registry import build_model

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return _DTYPES[name]


def _eos_token_ids(path: Path, mc: ModelConfig) -> tuple[int, ...]:
    """config.json's eos ids plus generation_config.json's (HF generate stops on the latter)."""
    ids = list(mc.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    return tuple(dict.fromkeys(int(i) for i in ids))


class ModelRunner:
    def __init__(self, config: EngineConfig, max_running_requests: int,
                 prefix_cache: bool | None = None, canary: CanaryConfig | None = None,
                 rank: int = 0) -> None:
        """`prefix_cache` None: on unless `config.disable_prefix_cache`; `canary` None: off;
        `rank`: which part of the model it holds under `config.tp` > 1 (runtime/scheduler/
        ranks.py starts the other ranks)."""
        self.config = config
        self.tp = tp = TensorParallel(rank, config.tp)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        elif tp.size > 1 and config.device == "cpu":  # the ranks share this machine's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp.size))
        self.model_path: Path = resolve_model_path(config.model)
        self.model_config = mc = ModelConfig.from_dir(self.model_path)
        self.context_len = min(config.context_length or mc.max_position_embeddings, mc.max_position_embeddings)
        self.device = serving_device(config.device, tp.rank)
        bind_thread(self.device)
        self.dtype = resolve_dtype(config.dtype, config.device)
        onednn = use_onednn(config.linear_backend, config.device, self.dtype)
        try:
            self.model = build_model(mc, self.model_path, self.dtype, str(self.device), onednn, tp,
                                     fp8_gemm=mc.fp8 is not None and config.fp8_gemm == "auto"
                                     and fp8_gemms_run(self.device))
        except torch.OutOfMemoryError as e:
            raise out_of_memory("the weights (the model does not fit this GPU)", e) from None
        self.quantized_matmuls = self._quantize(config) if config.quantization != "none" else 0
        if prefix_cache is None:
            prefix_cache = not config.disable_prefix_cache
        self.pool, self.kv = self._kv_cache(max_running_requests, prefix_cache)
        self.attn = create_attention_backend(config.attention_backend, self.pool,
                                             self.kv.req_to_token, mc.attention_scale,
                                             mc.sliding_windows)
        self.sampler = create_sampler_backend(config.sampler_backend, mc.vocab_size)
        self.needs_request_ids = self.sampler.needs_request_ids
        self.penalties = PenaltyState(max_running_requests, mc.vocab_size, self.device)
        self.eos_token_ids = _eos_token_ids(self.model_path, mc)
        # under TP every rank checks its own KV heads; the ranks join their violations
        self.canary = build_guard(canary, self.kv.req_to_token.table, self.pool, self.pool.num_slots,
                                  mc.vocab_size, isinstance(self.sampler, TokenOracleSampler),
                                  HeadSplit(tp.kv_split(mc), tp.rank),
                                  tp.all_max if tp.size > 1 else None)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.disable_cuda_graph:
            if not tp.graph_safe:
                log.info("decode graphs: off (the TP group's gloo collectives cannot be "
                         "captured; nccl, a GPU per rank, can)")
            elif self.attn.cuda_graph_safe and self.model.cuda_graph_safe:
                self.graphs = self.decode_graphs(min(config.cuda_graph_max_bs, max_running_requests))
            elif not self.model.cuda_graph_safe:
                log.info("decode graphs: off (the MoE experts read their counts on the host "
                         "in %s; the grouped path, bf16/fp16, can be captured)", self.dtype)
            else:
                log.info("decode graphs: off (%s cannot be captured; --attention-backend triton "
                         "or flashinfer can)", type(self.attn).__name__)
        log.info(
            "model %s: %d layers, dtype %s on %s, matmuls %s, attention %s%s",
            self.model_path, mc.num_layers, self.dtype, self.device,
            "oneDNN" if onednn else "torch", type(self.attn).__name__,
            f", TP rank {tp.rank} of {tp.size} ({self.model.num_kv_heads} KV heads)"
            if tp.size > 1 else "",
        )

    def _quantize(self, config: EngineConfig) -> int:
        """--quantization: int8/int4 weight-only on the CPU, fp8 GEMMs on CUDA; how many matmuls."""
        if config.quantization == "fp8":
            if not fp8_gemms_run(self.device):
                raise ValueError("--quantization fp8 needs CUDA at sm_89 or later (fp8 GEMMs); on "
                                 "the CPU use --quantization int8 or int4")
            done = quantize_fp8(self.model)
            log.info("fp8: %d matmuls in fp8 per output channel (torch._scaled_mm)", done)
            return done
        if self.device.type != "cpu":
            raise ValueError(f"--quantization {config.quantization} is a CPU mode (on CUDA: "
                             "--quantization fp8, or an fp8 checkpoint)")
        done = quantize(self.model, config.quantization, config.quant_max_rows)
        log.info("%s weight-only: %d matmuls (the quantized kernel up to %d rows a step)",
                 config.quantization, done, config.quant_max_rows)
        return done

    def _kv_cache(self, max_running_requests: int,
                  prefix_cache: bool) -> tuple[KVPool, KVCacheManager]:
        config, mc = self.config, self.model_config
        kv_heads = self.model.num_kv_heads  # this rank's
        shape = (mc.num_layers, config.page_size, kv_heads, mc.head_dim)
        scales = self._kv_scales() if config.kv_cache_dtype == "fp8_e4m3" else None
        num_pages, sized_by = kv_pages(
            self.device, config.max_total_tokens, config.mem_fraction_static, config.page_size,
            page_nbytes(*shape, FP8 if scales is not None else self.dtype),
        )
        num_pages = self.tp.min_int(num_pages)  # a page index means one slot on every rank
        try:  # one page more than the allocator hands out: decode graphs pad into it
            pool = KVPool(mc.num_layers, num_pages + 1, config.page_size, kv_heads, mc.head_dim,
                          self.dtype, self.device, scales)
            # under TP the table's writes travel with each forward to every rank
            table = ReqToTokenPool(max_running_requests, self.context_len, self.device,
                                   deferred=self.tp.size > 1 or None)
        except torch.OutOfMemoryError as e:
            raise out_of_memory(f"a KV pool of {num_pages * config.page_size} tokens", e) from None
        log.info("KV pool: %d tokens (%.0f MiB, %s%s) from %s", num_pages * config.page_size,
                 pool.num_pages * pool.page_bytes / 2**20, str(pool.dtype).removeprefix("torch."),
                 f", scales from {scales.source}" if scales is not None else "", sized_by)
        cache = RadixCache(config.page_size) if prefix_cache else None
        return pool, KVCacheManager(PageAllocator(num_pages, config.page_size), table, cache)

    def _kv_scales(self) -> KVScales:
        """An fp8 pool's per-layer scales: the checkpoint's, else 1.0 (runtime/kvcache/fp8.py)."""
        layers = self.model_config.num_layers
        return checkpoint_scales(self.model_path, layers) or KVScales.default(layers)

    @property
    def kv_cache_dtype(self) -> str:
        """--kv-cache-dtype as it resolved (sglang's names): fp8_e4m3, else the model's dtype."""
        if self.config.kv_cache_dtype == "fp8_e4m3":
            return "fp8_e4m3"
        return str(self.dtype).removeprefix("torch.")

    def decode_graphs(
        self, max_bs: int, capture: Callable[[Callable[[], None]], Graph] | None = None
    ) -> DecodeGraphs:
        """Decode graphs for batches up to max_bs (capture: see DecodeGraphs; None: CUDA)."""
        return DecodeGraphs(self.model, self.attn, self.pool, self.kv.req_to_token,
                            self.kv.allocator.num_pages, self.vocab_size, max_bs, capture)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @torch.inference_mode()
    def forward_batch(self, batch: ForwardBatch) -> ForwardOutput:
        """Run `batch` (built on the host; staged here if it is not yet). On a GPU nothing in
        here waits for the device: the results' copy to the host is started, not awaited."""
        bind_thread(self.device)  # the overlap scheduler runs forwards on a thread of its own
        batch = batch.to(self.device)
        self.kv.req_to_token.apply(batch.table_writes)
        rows = None
        if batch.mode == "extend":
            rows = batch.extend_lens_t.cumsum(0) - 1  # last new token of each request
        if self.graphs is not None and self.graphs.fits(batch):
            logits = self.graphs.replay(batch)  # [B, vocab]
        else:
            logits = self.model.forward(batch, self.attn, rows)  # [B, vocab]
        info = batch.sampling
        if info.penalty_resets is not None:
            self.penalties.reset(info.penalty_resets)
        sample_logits = logits
        if info.need_penalties:
            if batch.mode == "decode":
                self.penalties.accumulate(batch.req_pool_indices, batch.input_ids)
            sample_logits = self.penalties.apply(logits, batch.req_pool_indices, info)
        if info.logit_bias is not None:
            rows, tokens, biases = info.logit_bias
            sample_logits = sample_logits.index_put((rows, tokens), biases, accumulate=True)
        out = self.sampler.sample(sample_logits, info)
        result = ForwardOutput(out.next_token_ids, customized_info=out.customized_info)
        if self.canary is not None:
            self.canary.after_forward(batch, result)
        if batch.return_logprob:
            logprobs = torch.log_softmax(logits, dim=-1)
            result.logprobs = logprobs.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1)
            if batch.top_logprobs_num:
                values, ids = logprobs.topk(batch.top_logprobs_num, dim=-1)
                result.top_logprobs = (values, ids)
        return result.start_host_copy()
