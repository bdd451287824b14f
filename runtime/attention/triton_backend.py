"""Triton attention: paged decode and extend kernels that read K/V in place from the KV pool.

Both kernels find a position's KV slot through the req->token table (row `req_pool_indices[b]`),
then its page and offset in the page-major pool, and load K/V rows straight from the pool's
strided layer views: no gather into padded blocks, no [B, max_len] table built per step (so the
decode launch has fixed shapes for CUDA graphs). GQA: a decode program owns one request and one
KV head and computes all query heads of its group at once; an extend program owns one request,
one query head and BLOCK_M of the request's new tokens, causal over prefix + new tokens (the new
tokens' K/V are written to the pool first, so every key is read from the pool).
Softmax runs online in float32; with a float32 pool the dot products use IEEE float32 (no TF32),
so greedy output can be held token-exact against HF in float32.
An fp8 pool (--kv-cache-dtype fp8_e4m3): the kernels load float8_e4m3fn rows, convert them to
the model's dtype (exact: every e4m3 value is a bf16, fp16 and float32 value) and apply the
layer's scales, passed as arguments: K's to the scores (q . k * scale * k_scale), V's to the
output (each output row is a weighted mean of value rows). e4m3 conversions need sm_89 or later
(Triton has no fp8e4nv before), so `create` refuses an fp8 pool on an older GPU by name; and
of a float32 model on CUDA, whose IEEE dot products over converted fp8 rows spill registers on
sm_90 (tests/attention/test_triton_compile.py; bf16 and fp16 do not). `auto` then takes torch. The
new tokens are quantized by KVPool's own `quantize` (torch) and copied in by the store kernel:
Triton's fp8 rounding is not torch's in its interpreter, and the pool must hold the same bytes
whichever backend wrote them (cached == uncached, PD pages).
A layer with a sliding window W (SLIDING, a compile-time switch: each kind of layer has its own
kernel) starts its loop at the first key of its first query's window and hides, per query, the
keys at or before its position - W. Each query's first key then lies within BLOCK_M - 1 keys of
the loop's start, so inside the first block (BLOCK_M <= every BLOCK_N): no query meets a block
where it sees nothing before one where it sees something, which the online softmax, as written,
could not take (-inf - -inf).

CUDA only in production; under TRITON_INTERPRET=1 the same kernels run on CPU tensors (slowly),
which is how the CPU machines test them (tests/attention/test_triton_kernels.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.attention.base import AttentionBackend, BackendUnavailable
from runtime.forward_batch import ForwardBatch
from runtime.kvcache.fp8 import quantize
from runtime.kvcache.pool import KVPool
from runtime.kvcache.req_to_token import ReqToTokenPool
from runtime.triton_launch import Launch, interpreting, next_pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # the backend reports itself unavailable; nothing else imports this module
    triton = None

BLOCK_N = 64  # keys per loop step
BLOCK_M = 32  # extend: query tokens per program
# float32 extend: IEEE dot products over 64 keys spill registers on sm_90 (8 KB of stack per
# thread at head_dim 128; tests/attention/test_triton_compile.py), 32 keys do not
BLOCK_N_IEEE = 32
assert min(BLOCK_N, BLOCK_N_IEEE) >= BLOCK_M  # sliding windows: see the module's docstring
# the largest head the kernels take: at 256 (Gemma) ptxas spills the float32 decode and every
# extend kernel (tests/attention/test_triton_compile.py); `auto` then falls back to torch
MAX_HEAD_DIM = 128


# kernel argument lists read better packed than one per line
# fmt: off
if triton is not None:

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):  # type: ignore[no-untyped-def]
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _attend(  # type: ignore[no-untyped-def]
        q, K, V, Table, row, kvh, n, valid, sees, d, dmask, m_i, l_i, acc, scale,
        stride_kp, stride_kt, stride_kh, stride_tr, PAGE: tl.constexpr, IEEE: tl.constexpr,
    ):
        """Fold one block of keys (positions n; `sees`: which query row may see which) into the
        online softmax of q's rows: K/V rows are read from the pool through the table (`dmask`:
        the head's real columns, where its dim is padded to a power of two), as q's dtype
        (fp8 rows unscaled: `scale` holds K's, the caller applies V's)."""
        slot = tl.load(Table + row * stride_tr + n, mask=valid, other=0)
        at = (slot // PAGE) * stride_kp + (slot % PAGE) * stride_kt + kvh * stride_kh
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(K + at[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), IEEE) * scale  # [rows, keys]
        s = tl.where(sees, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(V + at[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, IEEE)
        return m_new, l_i * alpha + tl.sum(p, 1), acc

    @triton.jit
    def _decode_kernel(  # type: ignore[no-untyped-def]
        Q, K, V, Out, Table, ReqIdx, SeqLens, scale, k_scale, v_scale, window,
        stride_qb, stride_qh, stride_ob, stride_oh,
        stride_kp, stride_kt, stride_kh, stride_tr,
        PAGE: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, D: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr, SLIDING: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        seq_len = tl.load(SeqLens + b)
        row = tl.load(ReqIdx + b)
        g = tl.arange(0, GROUP_P2)
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        heads = kvh * GROUP + g
        rows = (g < GROUP)[:, None] & dmask[None, :]
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=rows, other=0.0)
        m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P2], tl.float32)
        acc = tl.zeros([GROUP_P2, BLOCK_D], tl.float32)
        first = 0
        if SLIDING:
            first = tl.maximum(seq_len - window, 0)  # its window: positions first .. seq_len - 1
        for start in range(first, seq_len, BLOCK):
            n = start + tl.arange(0, BLOCK)
            valid = n < seq_len
            m_i, l_i, acc = _attend(
                q, K, V, Table, row, kvh, n, valid, valid[None, :], d, dmask, m_i, l_i, acc,
                scale * k_scale, stride_kp, stride_kt, stride_kh, stride_tr, PAGE, IEEE,
            )
        out = acc * v_scale / l_i[:, None]
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=rows)

    @triton.jit
    def _extend_kernel(  # type: ignore[no-untyped-def]
        Q, K, V, Out, Table, ReqIdx, QStart, ExtLens, PrefixLens, scale, k_scale, v_scale, window,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kp, stride_kt, stride_kh, stride_tr,
        PAGE: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr, SLIDING: tl.constexpr,
    ):
        i = tl.program_id(0)
        h = tl.program_id(1)
        first = tl.program_id(2) * BLOCK_Q
        ext_len = tl.load(ExtLens + i)
        if first < ext_len:
            prefix = tl.load(PrefixLens + i)
            q_at = tl.load(QStart + i)
            row = tl.load(ReqIdx + i)
            kvh = h // GROUP
            mq = first + tl.arange(0, BLOCK_Q)  # query index among the request's new tokens
            q_valid = mq < ext_len
            d = tl.arange(0, BLOCK_D)
            dmask = d < D
            rows = q_valid[:, None] & dmask[None, :]
            q = tl.load(Q + (q_at + mq)[:, None] * stride_qt + h * stride_qh + d[None, :],
                        mask=rows, other=0.0)
            m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_Q], tl.float32)
            acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
            kv_len = prefix + tl.minimum(ext_len, first + BLOCK_Q)  # what its last query sees
            lo = 0
            if SLIDING:  # the first key its first query sees
                lo = tl.maximum(prefix + first - window + 1, 0)
            for start in range(lo, kv_len, BLOCK):
                n = start + tl.arange(0, BLOCK)
                valid = n < kv_len
                sees = valid[None, :] & (n[None, :] <= (prefix + mq)[:, None])  # causal
                if SLIDING:  # (padding rows take the last query's window: never stored)
                    last = prefix + tl.minimum(mq, ext_len - 1)
                    sees = sees & (n[None, :] > last[:, None] - window)
                m_i, l_i, acc = _attend(
                    q, K, V, Table, row, kvh, n, valid, sees, d, dmask, m_i, l_i, acc,
                    scale * k_scale, stride_kp, stride_kt, stride_kh, stride_tr, PAGE, IEEE,
                )
            out = acc * v_scale / l_i[:, None]
            tl.store(Out + (q_at + mq)[:, None] * stride_ot + h * stride_oh + d[None, :],
                     out.to(Out.dtype.element_ty), mask=rows)

    @triton.jit
    def _store_kv_kernel(  # type: ignore[no-untyped-def]
        K, V, KPool, VPool, Rows, stride_k, stride_v, W: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """Token t's K and V rows (W = KV heads * head_dim elements each) into the pool's layer
        views at element offset Rows[t]: one launch for both, where indexing takes two."""
        t = tl.program_id(0)
        at = tl.load(Rows + t)
        i = tl.arange(0, BLOCK)
        m = i < W
        tl.store(KPool + at + i, tl.load(K + t * stride_k + i, mask=m), mask=m)
        tl.store(VPool + at + i, tl.load(V + t * stride_v + i, mask=m), mask=m)
# fmt: on


def block_d(head_dim: int) -> int:
    """The kernels' head columns: a power of two >= 16 (what tl.dot takes); a head_dim short of
    it (80, 96) is padded, its extra columns masked off (loaded as 0, never stored)."""
    return max(16, next_pow2(head_dim))


def _kv_scales(pool: KVPool, layer: int) -> list[float]:
    """What both kernels take after the score's scale: the layer's K and V scales (1.0 for a
    pool that stores the model's dtype)."""
    if pool.scales is None:
        return [1.0, 1.0]
    return [pool.scales.k[layer], pool.scales.v[layer]]


def _strides(q: torch.Tensor, out: torch.Tensor, k: torch.Tensor, table: torch.Tensor) -> list[int]:
    """What both kernels take after their scalars: q's and out's row and head strides, the pool
    layer view's page, token and head strides, the req->token table's row stride."""
    return [q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k.stride(0), k.stride(1), k.stride(2), table.stride(0)]  # fmt: skip


def paged_decode(
    pool: KVPool,
    layer: int,
    q: torch.Tensor,
    table: torch.Tensor,
    req_idx: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> Launch:
    """q [B, H, D] -> [B, H, D]: request b attends to its first seq_lens[b] positions (the last
    `window` of them with a window)."""
    b, h, d = q.shape
    group = h // pool.num_kv_heads
    k, v = pool.pages(layer)  # [P, PS, KVH, D], strided
    out = torch.empty_like(q)
    return Launch(
        _decode_kernel,
        (b, pool.num_kv_heads),
        (q, k, v, out, table, req_idx, seq_lens, scale, *_kv_scales(pool, layer), window or 0,
         *_strides(q, out, k, table)),
        dict(PAGE=pool.page_size, GROUP=group, GROUP_P2=max(16, next_pow2(group)), D=d,
             BLOCK_D=block_d(d), BLOCK=BLOCK_N, IEEE=pool.compute_dtype == torch.float32,
             SLIDING=window is not None),
        out,
    )  # fmt: skip


def paged_extend(
    pool: KVPool,
    layer: int,
    q: torch.Tensor,
    table: torch.Tensor,
    req_idx: torch.Tensor,
    q_start: torch.Tensor,
    ext_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_extend: int,
    scale: float,
    window: int | None = None,
) -> Launch:
    """q [T, H, D] (requests' new tokens back to back) -> [T, H, D], causal over each
    request's prefix (from the pool) and its new tokens (already written to the pool), within
    the last `window` positions of each query with a window."""
    _, h, d = q.shape
    k, v = pool.pages(layer)
    out = torch.empty_like(q)
    ieee = pool.compute_dtype == torch.float32
    return Launch(
        _extend_kernel,
        (len(ext_lens), h, triton.cdiv(max_extend, BLOCK_M)),
        (q, k, v, out, table, req_idx, q_start, ext_lens, prefix_lens, scale,
         *_kv_scales(pool, layer), window or 0, *_strides(q, out, k, table)),
        dict(PAGE=pool.page_size, GROUP=h // pool.num_kv_heads, D=d, BLOCK_D=block_d(d),
             BLOCK_Q=BLOCK_M, BLOCK=BLOCK_N_IEEE if ieee else BLOCK_N, IEEE=ieee,
             SLIDING=window is not None),
        out,
    )  # fmt: skip


def store_kv(pool: KVPool, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Launch:
    """k, v [T, KV heads, D] (each token's heads contiguous) into the pool at `rows`
    (KVPool.row_offsets of the tokens' slots): what KVPool.write does, in one launch (an fp8
    pool's quantized first, by KVPool's rule)."""
    width = pool.num_kv_heads * pool.head_dim
    if pool.scales is not None:
        k, v = quantize(k, pool.scales.k[layer]), quantize(v, pool.scales.v[layer])
    k, v = (x if x.stride(1) == pool.head_dim and x.stride(2) == 1 else x.contiguous() for x in (k, v))
    k_pages, v_pages = pool.pages(layer)
    return Launch(_store_kv_kernel, (rows.shape[0],),
                  (k, v, k_pages, v_pages, rows, k.stride(0), v.stride(0)),
                  dict(W=width, BLOCK=next_pow2(width)), None)


def refuse_fp8_kv(pool: KVPool) -> None:
    """The fp8 pools of a CUDA device these kernels do not read (the module's docstring)."""
    if torch.cuda.get_device_capability(pool.device) < (8, 9):
        raise BackendUnavailable(
            "triton attention reads fp8 KV pages (--kv-cache-dtype fp8_e4m3) on sm_89 or later "
            "(Triton has no e4m3 conversion before): use --attention-backend torch")
    if pool.compute_dtype == torch.float32:
        raise BackendUnavailable(
            "triton attention reads fp8 KV pages for a bfloat16 or float16 model, not float32 "
            "(its kernels spill registers): use --dtype bfloat16 or --attention-backend torch")


class TritonAttention(AttentionBackend):
    cuda_graph_safe = True  # decode reads lengths and rows from tensors; its grid is (B, KV heads)

    @classmethod
    def create(cls, pool: KVPool, req_to_token: ReqToTokenPool, scale: float,
               windows: Sequence[int | None] = ()) -> TritonAttention:
        if triton is None:
            raise BackendUnavailable(
                "triton attention: the triton package is not installed (pip install 'baton[cuda]')"
            )
        if pool.scales is not None and pool.device.type == "cuda":
            refuse_fp8_kv(pool)
        if pool.device.type != "cuda" and not interpreting():
            raise BackendUnavailable(
                f"triton attention needs a CUDA pool, not {pool.device} "
                "(or TRITON_INTERPRET=1, for tests)"
            )
        if pool.head_dim > MAX_HEAD_DIM:
            raise BackendUnavailable(
                f"triton attention: head_dim {pool.head_dim} is above {MAX_HEAD_DIM}"
            )
        return cls(pool, req_to_token, scale, windows)

    def begin(self, batch: ForwardBatch) -> None:
        self.out_rows = self.pool.row_offsets(batch.out_cache_loc)
        self.req_idx = batch.req_pool_indices
        self.seq_lens = batch.seq_lens_t
        if batch.mode == "extend":
            self.ext_lens = batch.extend_lens_t
            self.q_start = self.ext_lens.cumsum(0) - self.ext_lens  # [B] first new token's row
            self.prefix_lens = self.seq_lens - self.ext_lens
            self.max_extend = max(batch.extend_lens)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        store_kv(self.pool, layer, self.out_rows, k, v).run()
        table = self.req_to_token.table
        if batch.mode == "decode":
            out = paged_decode(self.pool, layer, q.contiguous(), table, self.req_idx,
                               self.seq_lens, self.scale, self.window(layer)).run()
        else:
            out = paged_extend(
                self.pool,
                layer,
                q.contiguous(),
                table,
                self.req_idx,
                self.q_start,
                self.ext_lens,
                self.prefix_lens,
                self.max_extend,
                self.scale,
                self.window(layer),
            ).run()
        return out.view(out.shape[0], -1)
