"""FP8 KV pages (`--kv-cache-dtype fp8_e4m3`): the pool stores float8_e4m3fn under per-layer
scales and gives back the model's dtype; the scales come from the checkpoint or default to 1.0;
the KV layout names the dtype and the scales, so servers that differ in either do not pair;
every attention backend reads fp8 pages."""

from __future__ import annotations

import socket
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runtime.attention.cpu_backend import CpuAttention
from runtime.attention.registry import create_attention_backend
from runtime.disagg.fence import WriteFence
from runtime.disagg.shares import Share
from runtime.disagg.transfer.base import layout_of
from runtime.disagg.transfer.tcp import TcpTransfer
from runtime.disagg.wire import KVLayout, PagesFrame, PeerRegistration, recv_frame
from runtime.kvcache.fp8 import FP8, KVScales, checkpoint_scales, quantize
from runtime.kvcache.pool import KVPool
from runtime.kvcache.req_to_token import ReqToTokenPool
from runtime.router.workers import kv_difference
from runtime.server.args import parse_server_args

SCALES = KVScales((0.5, 2.0), (4.0, 0.25), "test")


def fp8_pool(scales: KVScales = SCALES, num_pages: int = 8, heads: int = 2) -> KVPool:
    return KVPool(len(scales.k), num_pages, 4, heads, 8, torch.float32, scales=scales)


def test_pages_are_fp8_and_read_back_in_the_models_dtype_under_each_layers_scale() -> None:
    pool = fp8_pool()
    assert pool.dtype == FP8 and pool.buffer.element_size() == 1
    assert pool.page_bytes == KVPool(2, 8, 4, 2, 8, torch.float32).page_bytes // 4
    loc = pool.locate(torch.tensor([0, 5, 30]))
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
    for layer in range(2):
        pool.write(layer, loc, x, 3 * x)
        k, v = pool.read(layer, loc)
        assert k.dtype == torch.float32
        # e4m3 keeps 3 mantissa bits: within 1/16 of the value (plus the subnormals' step)
        tol = dict(rtol=1 / 16, atol=2**-9 * max(SCALES.k[layer], SCALES.v[layer]))
        torch.testing.assert_close(k, x, **tol)
        torch.testing.assert_close(v, 3 * x, **tol)
        # stored as x / scale: the raw fp8 of K differs between layers of different scales
        k_raw = pool.pages(layer)[0][loc]
        assert torch.equal(k_raw, (x / SCALES.k[layer]).to(FP8))
        # what the pool holds is what as_stored says an extend attends to
        assert torch.equal(pool.as_stored(layer, x, 3 * x)[0], k)
        pages = pool.gather_pages(layer, torch.tensor([1]))[0]  # slot 5 = page 1, offset 1
        assert torch.equal(pages[0, 1], k[1])


def test_values_past_the_fp8_range_saturate_to_448_times_the_scale() -> None:
    pool = fp8_pool()
    loc = pool.locate(torch.tensor([3, 4]))
    big = torch.tensor([[1e4], [-1e9]]).expand(2, 2 * 8).reshape(2, 2, 8)
    pool.write(1, loc, big, big)
    k, v = pool.read(1, loc)
    assert torch.equal(k[:, 0, 0], torch.tensor([448.0 * 2.0, -448.0 * 2.0]))
    assert torch.equal(v[:, 0, 0], torch.tensor([448.0 * 0.25, -448.0 * 0.25]))
    assert not quantize(torch.tensor([1e30, -1e30]), 1.0).float().isnan().any()


def test_scales_come_from_the_checkpoint_else_none(tmp_path: Path) -> None:
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
               "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
               "model.layers.1.self_attn.kv_scale": torch.tensor(3.0),  # one for both
               "model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)},
              str(tmp_path / "model.safetensors"))
    scales = checkpoint_scales(tmp_path, 2)
    assert scales == KVScales((0.5, 3.0), (0.25, 3.0), "the checkpoint")
    with pytest.raises(ValueError, match=r"miss \['layer 2 k_scale', 'layer 2 v_scale'\]"):
        checkpoint_scales(tmp_path, 3)
    (tmp_path / "model.safetensors").unlink()
    save_file({"model.norm.weight": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    assert checkpoint_scales(tmp_path, 2) is None
    assert KVScales.default(2).k == (1.0, 1.0)
    with pytest.raises(ValueError, match="not a positive finite scale"):
        KVScales((0.0,), (1.0,), "bad")


def test_the_layout_names_the_dtype_and_the_scales_and_fp8_pairs_only_with_its_like() -> None:
    fp8, other_scales = layout_of(fp8_pool()), layout_of(fp8_pool(KVScales.default(2)))
    bf16 = layout_of(KVPool(2, 8, 4, 2, 8, torch.bfloat16))
    assert fp8.dtype == "float8_e4m3fn" and fp8.kv_scales == SCALES.digest
    assert fp8.page_bytes == bf16.page_bytes // 2  # half the bytes per page
    assert "kv_scales" not in bf16.pairing()  # a layout without fp8 reads as it always did
    assert fp8.mismatch(layout_of(fp8_pool())) is None
    assert fp8.mismatch(other_scales) == f"kv_scales {SCALES.digest} vs {KVScales.default(2).digest}"
    assert str(bf16.mismatch(fp8)).startswith("dtype bfloat16 vs float8_e4m3fn")
    # the router's reason for not pairing a bf16 prefill with an fp8 decode names the dtype
    why = kv_difference({"backend": "tcp", "layout": bf16.pairing()},
                        {"backend": "tcp", "layout": fp8.pairing()})
    assert "dtype bfloat16 vs float8_e4m3fn" in why and "kv_scales None vs" in why
    with pytest.raises(ValueError, match="an fp8 pool has scales"):
        KVLayout(2, 4, 2, 8, "float8_e4m3fn")


def test_auto_keeps_the_native_cpu_backend_for_an_fp8_pool_and_serve_takes_any_backend() -> None:
    """Every backend reads fp8 pages (tests/attention/test_fp8_backends.py): `auto` on the CPU is
    still the native kernel, and no --attention-backend is refused for fp8 KV."""
    pool = KVPool(2, 8, 4, 2, 32, torch.float32, scales=SCALES)  # a head the kernel takes
    table = ReqToTokenPool(2, 64, "cpu")
    assert isinstance(create_attention_backend("auto", pool, table, 1.0), CpuAttention)
    for backend in ("auto", "torch", "cpu", "triton", "flashinfer"):
        args = parse_server_args(["--kv-cache-dtype", "fp8_e4m3", "--attention-backend", backend])
        assert (args.engine.kv_cache_dtype, args.engine.attention_backend) == ("fp8_e4m3", backend)


def test_a_tp_share_of_fp8_pages_lands_in_the_same_heads_of_a_decode_ranks_pages() -> None:
    """Prefill with one rank, decode rank 1 of 2 (it holds KV head 1): tcp's share path views
    the pool by dtype, fp8 included."""
    src, dst = fp8_pool(heads=2), fp8_pool(heads=1)
    src.buffer.copy_(torch.randn(src.buffer.shape).to(FP8))
    before = dst.buffer.clone()
    layout = layout_of(src)
    fence = WriteFence(rank=1)
    sender = TcpTransfer(src, "p", layout=layout)
    receiver = TcpTransfer(dst, "d", fence, KVLayout(**{**layout.pairing(), "tp_size": 2}), rank=1)
    share = Share(0, 1, 1, 2)
    peer = PeerRegistration("d", "h", 1, asdict(receiver.layout), "tcp", ranks=[["h", 2]])
    fence.expect(5, [6, 2], "p")
    assert fence.bind_peer(5, "p", [share])
    a, b = socket.socketpair()
    with a, b:
        sender.write_share(peer, a, 5, [1, 3], [6, 2], share)
        frame = recv_frame(b, 1 << 20)
        assert isinstance(frame, PagesFrame)
        assert receiver.read_pages(frame, b, "p")
    assert torch.equal(dst.buffer[[6, 2]], src.buffer[[1, 3], :, :, :, 1:2])
    assert torch.equal(dst.buffer[[0, 1, 3, 4, 5, 7]], before[[0, 1, 3, 4, 5, 7]])
