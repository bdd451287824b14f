"""`baton serve --tp N`: a real server whose scheduler process leads N-1 follower ranks. It gives
HF's greedy tokens; a follower that dies, or one that hangs, ends the whole server in bounded
time (the HTTP process exits non-zero, no rank is left behind: never a hang); a split the model
cannot take is refused at start-up, before anything starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.engine.hf_reference import PROMPTS, compare, hf_greedy
from tests.models.checkpoints import SHAPE, write_checkpoint
from tests.server.server_process import BATON_CMD, REPO, ServerProcess, start_server

pytestmark = pytest.mark.timeout(240)
ENDS_WITHIN_S = 45.0


@pytest.fixture(scope="module")
def qwen2(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("Qwen2Config", tmp_path_factory.mktemp("qwen2") / "ckpt", model_path,
                            **dict(SHAPE, tie_word_embeddings=False))


def followers(server: ServerProcess) -> list[int]:
    """The follower ranks: the scheduler process's children running runtime.scheduler.ranks."""
    sched = server.scheduler_pid()
    pids = Path(f"/proc/{sched}/task/{sched}/children").read_text().split()
    return [int(p) for p in pids if b"runtime.scheduler.ranks" in Path(f"/proc/{p}/cmdline").read_bytes()]


def streamed(url: str, body: dict[str, object]) -> list[int]:
    """The output ids of /generate's SSE stream, chunk by chunk."""
    ids: list[int] = []
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ids += json.loads(line[6:]).get("output_ids", [])
    return ids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def ends(server: ServerProcess, pids: list[int]) -> int:
    """The server's exit code, once it and every rank are gone (bounded)."""
    code = server.proc.wait(ENDS_WITHIN_S)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "a rank outlived its server"
    return code


def test_serve_tp2_gives_hf_tokens_and_a_dead_rank_ends_the_server(qwen2: Path,
                                                                   tmp_path: Path) -> None:
    server = start_server("--tp", "2", log_path=tmp_path / "server.log", model=str(qwen2))
    try:
        info = httpx.get(f"{server.url}/server_info", timeout=10).json()
        assert info["tp"] == 2
        from transformers import AutoTokenizer

        ids = [AutoTokenizer.from_pretrained(qwen2).encode(p) for p in PROMPTS[:3]]
        refs = hf_greedy(qwen2, ids, 16)
        for prompt, ref in zip(ids, refs, strict=True):
            body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
            out = httpx.post(f"{server.url}/generate", timeout=60, json=body)
            assert out.status_code == 200, out.text
            assert compare(out.json()["output_ids"], ref) is None
            assert compare(streamed(server.url, body), ref) is None
        ranks = followers(server)
        assert len(ranks) == 1
        sched = server.scheduler_pid()
        os.kill(ranks[0], signal.SIGKILL)
        assert ends(server, [sched, *ranks]) != 0
        assert "TP rank 1 exited" in server.log()
    finally:
        server.kill()


def test_a_hung_rank_ends_the_server_in_bounded_time(qwen2: Path, tmp_path: Path) -> None:
    server = start_server("--tp", "2", "--tp-timeout-s", "5", log_path=tmp_path / "server.log",
                          model=str(qwen2))
    try:
        ranks, sched = followers(server), server.scheduler_pid()
        os.kill(ranks[0], signal.SIGSTOP)
        start = time.monotonic()
        try:
            out = httpx.post(f"{server.url}/generate", timeout=ENDS_WITHIN_S, json={
                "text": "Hello", "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
            # ended, never left hanging: the scheduler aborts what it held as it exits (naming
            # the collective that timed out), or the HTTP side fails it with a 503
            if out.status_code == 200:
                reason = out.json()["meta_info"]["finish_reason"]
                assert reason["type"] == "abort" and "Timed out" in reason["message"], reason
            else:
                assert out.status_code == 503, out.text
        except httpx.TransportError:
            pass  # the server went before it could answer
        assert ends(server, [sched, *ranks]) != 0
        assert time.monotonic() - start < ENDS_WITHIN_S
    finally:
        for pid in ranks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        server.kill()


def test_serve_refuses_a_split_the_model_cannot_take(model_path: Path) -> None:
    run = subprocess.run([*BATON_CMD, "serve", "--model", str(model_path), "--tp", "2"],
                         capture_output=True, text=True, timeout=60, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert run.returncode == 2, run.stderr
    assert "--tp 2 does not divide the model's 9 attention heads" in run.stderr
    assert "Traceback" not in run.stderr


def test_tp_alias_and_what_it_does_not_serve_yet(capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.server.args import parse_server_args

    assert parse_server_args(["--tensor-parallel-size", "4"]).engine.tp == 4
    pd = ["--tp", "2", "--role", "decode", "--kv-transfer"]
    for backend in ("tcp", "nixl"):  # PD over ranks: either backend
        assert parse_server_args([*pd, backend]).disagg.kv_transfer == backend
    canary = parse_server_args([*pd, "tcp", "--kv-canary", "raise", "--kv-canary-bytes", "all"])
    assert canary.canary.kv_canary_bytes == "all"  # every rank's KV heads summed
    for argv, why in ((["--tp", "0"], "--tp must be >= 1"),
                      (["--tp-timeout-s", "0"], "--tp-timeout-s must be > 0")):
        with pytest.raises(SystemExit):
            parse_server_args(argv)
        assert why in capsys.readouterr().err, argv
