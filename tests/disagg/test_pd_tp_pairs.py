"""PD over nixl and over tcp with tensor parallelism on either side (runtime/disagg/shares.py;
transfer/nixl.py, tcp.py): real `baton serve` processes with their follower ranks and the
cluster key on (over nixl each rank with its own agent) give HF transformers' greedy tokens and
logprobs, every page freed on every side after and the KV canary's tags and byte checksums
(summed over the ranks) clean. Servers are shared: each prefill pairs with each decode. On the
sharp tiny Llama (4 heads, 2 KV heads) P1/P2 x D1/D2: one rank each side (over nixl the aux
record is the WRITE's notification), each decode page's two halves from two prefill ranks, each
prefill page split by head range into two decode ranks (nixl: descriptors per row), and equal TP
(page runs). On the builtin model (3 KV heads) P3 -> D1 and P1 -> D3: slow, 8 rank processes."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.auth.key import ENV
from tests.disagg.pd import Pair
from tests.disagg.test_pd_tp import MAX_NEW, assert_pd_equals_hf
from tests.engine.hf_reference import PROMPTS, Reference, hf_greedy
from tests.ports import free_port
from tests.server.server_process import ServerProcess

pytestmark = pytest.mark.timeout(400)
Servers = dict[str, ServerProcess]


def start_servers(log_dir: Path, model: Path, prefill_tps: tuple[int, ...],
                  decode_tps: tuple[int, ...], transport: str = "nixl",
                  ) -> tuple[Servers, dict[str, int], str]:
    """Prefill and decode servers over `transport` with the KV canary in `raise` mode (every
    layer's byte checksums) and one cluster key, loading at once: {"p1": ..., "d2": ...}, the
    prefills' bootstrap ports, the key."""
    if transport == "nixl":
        pytest.importorskip("nixl")
    key, ports = secrets.token_hex(32), {f"p{tp}": free_port() for tp in prefill_tps}
    common = ("--kv-transfer", transport, "--kv-canary", "raise", "--kv-canary-bytes", "all")
    servers: Servers = {}
    try:
        for name, port in ports.items():
            servers[name] = ServerProcess(
                "--role", "prefill", "--bootstrap-port", str(port), "--tp", name[1:], *common,
                model=str(model), env={ENV: key}, log_path=log_dir / f"{name}.log")
        for tp in decode_tps:
            servers[f"d{tp}"] = ServerProcess(
                "--role", "decode", "--kv-port", "0", "--tp", str(tp), *common, model=str(model),
                env={ENV: key}, log_path=log_dir / f"d{tp}.log")
        for srv in servers.values():
            srv.wait_ready()
    except BaseException:
        stop(servers)
        raise
    return servers, ports, key


def stop(servers: Servers) -> None:
    for srv in servers.values():  # all at once: each waits for its ranks to leave
        srv.terminate()
    for srv in servers.values():
        if srv.proc.poll() is None:
            srv.stop()


def pair_of(started: tuple[Servers, dict[str, int], str], p_tp: int, d_tp: int) -> Pair:
    servers, ports, key = started
    return Pair(servers[f"p{p_tp}"], servers[f"d{d_tp}"], ports[f"p{p_tp}"], key)


@pytest.fixture(scope="module", params=["nixl", "tcp"])
def tiny(request: pytest.FixtureRequest, sharp_tiny_path: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Servers, dict[str, int], str]]:
    started = start_servers(tmp_path_factory.mktemp(f"pd-tp-{request.param}"), sharp_tiny_path,
                            (1, 2), (1, 2), request.param)
    yield started
    stop(started[0])


@pytest.fixture(scope="module")
def tiny_refs(sharp_tiny_path: Path) -> tuple[list[list[int]], list[Reference]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sharp_tiny_path)
    ids = [tok.encode(p) for p in PROMPTS[:4]]
    return ids, [r.head(MAX_NEW) for r in hf_greedy(sharp_tiny_path, ids, MAX_NEW)]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2), (2, 2)],
                         ids=["p1-d1", "p2-d1", "p1-d2", "p2-d2"])
def test_pd_between_any_tp_equals_hf(
        tiny: tuple[Servers, dict[str, int], str], tiny_refs: tuple[list[list[int]], list[Reference]],
        p_tp: int, d_tp: int) -> None:
    assert_pd_equals_hf(pair_of(tiny, p_tp, d_tp), *tiny_refs)


@pytest.mark.slow
@pytest.mark.parametrize("transport", [
    "nixl", pytest.param("tcp", marks=pytest.mark.skipif(
        not os.environ.get("BATON_TP_MATRIX"), reason="tcp's three-way split runs with "
        "BATON_TP_MATRIX=1 (the suite runs it over nixl, and tcp's splits on the tiny model)"))])
def test_pd_with_three_ranks_on_one_side_equals_hf(
        model_path: Path, tmp_path: Path, prompt_ids: list[list[int]], transport: str) -> None:
    """The builtin model, one KV head per rank over 3 ranks: P3 -> D1 writes a third of each
    decode page's heads from each prefill rank, P1 -> D3 a third of each prefill page into each
    decode rank (near-ties allowed: its logits are not sharp)."""
    ids = prompt_ids[:2]
    want = [r.head(6) for r in hf_greedy(model_path, ids, 6)]
    started = start_servers(tmp_path, model_path, (1, 3), (1, 3), transport)
    try:
        for p_tp, d_tp in ((3, 1), (1, 3)):
            assert_pd_equals_hf(pair_of(started, p_tp, d_tp), ids, want, near_ties=True)
    finally:
        stop(started[0])
