"""API keys at the front door (issue: the front door): a worker and a router that require a key
answer 401 in the OpenAI shape without one or with a wrong one, serve the OpenAI SDK with the
right one, keep the probes open, never echo or log a key, and take a rotated key file without
a restart and without cutting a stream in flight."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from runtime.auth.api_keys import ApiKeys
from tests.router.router_process import start_router
from tests.server.server_process import ServerProcess

KEY, OTHER = "sk-first-0123456789", "sk-second-9876543210"
ADMIN = "sk-admin-5555555555"


def test_keys_from_flags_env_and_a_file_that_changes(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# rotated monthly\n\nsk-a\n")
    keys = ApiKeys.load(["sk-flag"], str(path), {"BATON_API_KEY": "sk-env1, sk-env2"})
    assert keys.keys() == ("sk-flag", "sk-env1", "sk-env2", "sk-a")
    assert keys.allows("Bearer sk-a") and keys.allows("bearer sk-env2")
    assert not keys.allows("Bearer sk-b") and not keys.allows("sk-a") and not keys.allows(None)
    assert keys.presented() == {"Authorization": "Bearer sk-flag"}
    path.write_text("sk-b\n")
    keys._checked = 0.0  # (the reload interval passed)
    assert keys.allows("Bearer sk-b") and not keys.allows("Bearer sk-a")
    assert not ApiKeys().enabled and ApiKeys().allows(None) and ApiKeys().presented() == {}
    with pytest.raises(ValueError, match="--api-key-file"):
        ApiKeys(path=str(tmp_path / "missing"))


@pytest.mark.parametrize("content", ["", "\n  \n", "# the key goes here\n#sk-commented\n", None],
                         ids=["empty", "blank", "comments", "deleted"])
def test_a_key_file_without_keys_refuses_everyone_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str | None) -> None:
    """Fail closed: a key file rewritten (or deleted) so that it yields no key refuses every
    request, with a warning, at the next reload; one that holds none at start-up too."""
    path = tmp_path / "keys"
    path.write_text("sk-a\n")
    keys = ApiKeys(path=str(path))
    assert keys.allows("Bearer sk-a")
    if content is None:
        path.unlink()
    else:
        path.write_text(content)
    keys._checked = 0.0  # (the reload interval passed)
    with caplog.at_level("WARNING", "runtime.auth.api_keys"):
        assert keys.enabled and not keys.allows(None) and not keys.allows("Bearer sk-a")
        assert not keys.allows("Bearer ") and not keys.allows("Bearer")
    assert "every request but the probes is refused" in caplog.text, caplog.text
    caplog.clear()
    if content is not None:
        with caplog.at_level("WARNING", "runtime.auth.api_keys"):
            fresh = ApiKeys(path=str(path))
        assert not fresh.allows(None) and not fresh.allows("Bearer ") and "refused" in caplog.text
    path.write_text("sk-b\n")  # keys again: back in service
    keys._checked = 0.0
    assert keys.allows("Bearer sk-b")
    both = ApiKeys(["sk-flag"], str(path))
    path.write_text("")
    both._checked = 0.0
    assert both.allows("Bearer sk-flag") and not both.allows("Bearer sk-b")  # the flag's key holds


def test_worker_and_router_with_an_empty_key_file_refuse_everyone(tiny_path: Path, tmp_path: Path) -> None:
    empty = tmp_path / "keys"
    empty.write_text("# filled in by the deployment\n")
    srv = ServerProcess("--api-key-file", str(empty), model=str(tiny_path),
                        log_path=tmp_path / "server.log")
    router = None
    try:
        srv.wait_ready()
        router = start_router("--prefill", f"{srv.url},1", "--decode", srv.url, "--api-key-file",
                              str(empty), log_path=tmp_path / "router.log", ready=False)
        deadline = time.monotonic() + 30
        while not _answers(f"{router.url}/health"):
            assert time.monotonic() < deadline, router.log()
            time.sleep(0.1)
        for side in (srv, router):
            for path in ("/v1/models", "/v1/completions", "/generate"):
                r = httpx.post(f"{side.url}{path}", json={"prompt": "hi", "text": "hi"},
                               headers={"Authorization": "Bearer anything"})
                assert r.status_code == 401 and "no valid API key" in r.text, (side.url, path, r.text)
            assert httpx.get(f"{side.url}/health").status_code == 200
            assert "every request but the probes is refused" in side.log()
    finally:
        if router is not None:
            router.stop()
        srv.stop()


@pytest.fixture(scope="module")
def keyed(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    logs = tmp_path_factory.mktemp("keyed")
    key_file = logs / "keys"
    key_file.write_text(f"{KEY}\n")
    srv = ServerProcess("--api-key-file", str(key_file), "--served-model-name", "tiny",
                        "--admin-api-key", ADMIN, model=str(tiny_path),
                        log_path=logs / "server.log")
    srv.wait_ready()
    yield srv, key_file
    srv.stop()


def test_no_key_or_a_wrong_key_is_401_and_the_probes_stay_open(keyed: tuple[ServerProcess, Path]) -> None:
    srv, _ = keyed
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": f"Bearer {OTHER}"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        r = httpx.post(f"{srv.url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert KEY not in r.text and OTHER not in r.text
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{srv.url}{path}").status_code == 200, path
    assert httpx.get(f"{srv.url}/v1/models").status_code == 401
    assert KEY not in srv.log() and OTHER not in srv.log()


def test_the_debug_views_are_the_admin_keys(keyed: tuple[ServerProcess, Path],
                                             tmp_path: Path) -> None:
    """Issue #34 item 5: the block hashes of /debug/prefix_cache (and every /debug/ view) are
    the operator's: a client's key gets 403, the admin key (which passes the gate everywhere)
    gets them. /kv_events stays the router's (any valid key). The router likewise, and one
    with keys but no admin key shows its debug views to nobody."""
    srv, _ = keyed
    client, admin = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {ADMIN}"}
    for path in ("/debug/prefix_cache", "/debug/stats"):
        r = httpx.get(f"{srv.url}{path}", headers=client)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required", r.text
        assert httpx.get(f"{srv.url}{path}", headers=admin).status_code == 200
        assert httpx.get(f"{srv.url}{path}").status_code == 401
    assert httpx.get(f"{srv.url}/v1/models", headers=admin).status_code == 200
    with httpx.stream("GET", f"{srv.url}/kv_events", headers=client, timeout=10) as r:
        assert r.status_code == 200
    for flags, admin_status in ((("--admin-api-key", ADMIN), 200), ((), 401)):
        router = start_router("--prefill", f"{srv.url},1", "--decode", srv.url, "--api-key",
                              KEY, *flags, log_path=tmp_path / "router.log", ready=False)
        try:
            deadline = time.monotonic() + 30
            while not _answers(f"{router.url}/health"):
                assert time.monotonic() < deadline, router.log()
                time.sleep(0.1)
            for path in ("/debug/kv_index", "/debug/pairs"):
                r = httpx.get(f"{router.url}{path}", headers=client)
                assert r.status_code == 403, r.text
                assert (httpx.get(f"{router.url}{path}", headers=admin).status_code
                        == admin_status)
            if not flags:
                assert "--admin-api-key" in r.json()["error"]["message"]
            # aggregate figures for the operator's planner: open like /metrics
            assert httpx.get(f"{router.url}/debug/planner").status_code == 200
            assert ADMIN not in router.log()
        finally:
            assert router.stop() == 0


def test_the_openai_sdk_works_with_the_key(keyed: tuple[ServerProcess, Path]) -> None:
    srv, _ = keyed
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY)
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
    assert out.usage is not None and out.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{srv.url}/v1", api_key=OTHER).models.list()


def test_a_rotated_key_file_takes_effect_without_cutting_a_stream(
        keyed: tuple[ServerProcess, Path]) -> None:
    srv, key_file = keyed
    body = {"text": "Count:", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}}
    tokens = 0
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"{srv.url}/generate", json=body,
            headers={"Authorization": f"Bearer {KEY}"}) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            tokens += len(json.loads(line[6:])["output_ids"])
            if tokens == 1:  # mid-stream: the Secret now holds the new key only
                key_file.write_text(f"{OTHER}\n")
                deadline = time.monotonic() + 15
                while httpx.get(f"{srv.url}/v1/models",
                                headers={"Authorization": f"Bearer {OTHER}"}).status_code != 200:
                    assert time.monotonic() < deadline, "the new key never took effect"
                    time.sleep(0.2)
    assert tokens == 400  # the stream that began under the old key ran to its end
    old = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert old.status_code == 401
    key_file.write_text(f"{KEY}\n")  # back, for the other tests: once it took effect
    deadline = time.monotonic() + 15
    while httpx.get(f"{srv.url}/v1/models",
                    headers={"Authorization": f"Bearer {KEY}"}).status_code != 200:
        assert time.monotonic() < deadline, "the key file's first key never came back"
        time.sleep(0.2)


def test_router_and_workers_behind_it(keyed: tuple[ServerProcess, Path], tmp_path: Path) -> None:
    """A router with a key requires it of clients and presents it to the workers behind it,
    whose own key check that passes: /v1/models goes through to the keyed worker."""
    srv, _ = keyed
    router = start_router("--prefill", f"{srv.url},1", "--decode", srv.url, "--api-key", KEY,
                          "--protect-metrics", log_path=tmp_path / "router.log", ready=False)
    try:
        deadline = time.monotonic() + 30
        while not _answers(f"{router.url}/health"):
            assert time.monotonic() < deadline, router.log()
            time.sleep(0.1)
        assert httpx.get(f"{router.url}/v1/models").status_code == 401
        assert httpx.get(f"{router.url}/metrics").status_code == 401  # --protect-metrics
        planner = httpx.get(f"{router.url}/debug/planner", headers={"Authorization": f"Bearer {KEY}"})
        assert planner.status_code == 403, planner.text  # and then the admin key's alone
        assert httpx.get(f"{router.url}/health").status_code == 200
        deadline = time.monotonic() + 15
        while True:  # until the router has seen the worker ready
            r = httpx.get(f"{router.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            if r.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny", r.text
        assert KEY not in router.log()
    finally:
        assert router.stop() == 0


def _answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.ConnectError:
        return False
