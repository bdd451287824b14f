"""`baton up`: router + 1 prefill + 1 decode as local processes (tiny random Llama, tcp).

It gets ready, answers OpenAI requests through the router (stream and not), and leaves no
process behind: on SIGTERM (exit 0) and when it is SIGKILLed itself (parent-death signal)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from runtime.launch import parse, plan
from runtime.router.args import build_parser as router_parser
from runtime.server.args import parse_server_args
from tests.up_process import Up, alive, descendants

API_KEY = "sk-up-0123456789abcdef"


@pytest.fixture
def up(tiny_path: Path, tmp_path: Path) -> Iterator[Up]:
    u = Up(tiny_path, tmp_path, "--kv-transfer", "tcp", "--api-key", API_KEY)
    yield u
    u.close()


def test_plan_renders_what_serve_and_router_parse(tmp_path: Path) -> None:
    args, extra = parse(["--prefill", "2", "--decode", "3", "--port", "9000", "--kv-transfer",
                         "tcp", "--", "--max-total-tokens", "8192"])
    children = plan(args, extra, tmp_path)
    assert [c.name for c in children] == ["prefill-0", "prefill-1", "decode-0", "decode-1",
                                          "decode-2", "router"]
    for c in children[:-1]:
        serve = parse_server_args(c.cmd[c.cmd.index("serve") + 1:])
        assert serve.role == c.name.split("-")[0] and serve.engine.max_total_tokens == 8192
        assert serve.disagg.kv_transfer == "tcp"
    router = router_parser().parse_args(children[-1].cmd[children[-1].cmd.index("router") + 1:])
    assert router.port == 9000 and len(router.prefill) == 2 and len(router.decode) == 3


def test_serves_through_the_router_and_stops_everything(up: Up) -> None:
    up.wait_up()
    text = up.text()
    assert f"curl {up.url}/v1/chat/completions" in text and "[5/5]" not in text
    chat = {"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
            "temperature": 0}
    assert "Authorization: Bearer" in text  # its curl example says the router wants a key
    assert httpx.post(f"{up.url}/v1/chat/completions", json=chat).status_code == 401
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        r = http.post(f"{up.url}/v1/chat/completions", json=chat)
        assert r.status_code == 404, r.text  # served under its path, not "x"
        model = http.get(f"{up.url}/v1/models").json()["data"][0]["id"]
        r = http.post(f"{up.url}/v1/chat/completions", json={**chat, "model": model})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        with http.stream("POST", f"{up.url}/v1/completions", json={
                "model": model, "prompt": "Hello", "max_tokens": 5, "stream": True}) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[0][6:])["choices"]
    kids = descendants(up.proc.pid)
    assert len(kids) >= 5  # router, 2 servers with a scheduler process each
    for pid in kids:  # the key is in the router's environment, on no command line
        assert API_KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(60) == 0, up.text()
    deadline = time.monotonic() + 10
    while alive(kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(kids), f"left behind: {alive(kids)}"


def test_killed_baton_up_takes_its_children_along(up: Up) -> None:
    up.wait_up()
    kids = descendants(up.proc.pid)
    up.proc.kill()
    up.proc.wait(10)
    deadline = time.monotonic() + 15
    while alive(kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(kids), f"left behind after SIGKILL: {alive(kids)}"
