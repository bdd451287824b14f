"""`kubectl apply` → operator → pods as local processes → router → streamed tokens.

One cluster for the module (tests/e2e/cluster.py); the tests run in order on the sample
service: it becomes Ready, serves the colocated server's greedy output through the router
pod, scales its decode pool out and in under load, follows the P:D planner; at 2P+2D, a
revision whose prefill corrupts its KV is stopped by the rollout gate while the old one
serves, and a sound one rolls out in step under streams; back at 1P+1D it rolls to a decode
pool of three TP ranks per pod and answers through it, survives a killed prefill; then the
operator that `helm template` renders, run as a pod, takes it over and repairs it; last,
deleting it removes everything it made.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import kubernetes
import openai
import pytest
import yaml
from baton_operator.planning import pod_ready

from tests.e2e.cluster import OPERATOR_ENV, REPO, LocalCluster
from tests.kube.isvc_helpers import Cluster, wait_for
from tests.kube.kubectl_tool import helm, kubectl, run_kubectl, table_cells
from tests.server.server_process import ServerProcess
from tests.up_process import alive, descendants

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow, pytest.mark.solo]
NS, NAME = "serving", "smollm2"
SAMPLE = REPO / "manifests" / "samples" / "inferenceservice.yaml"
READY_S = 240  # three model servers loading at once on two cores
KV_TOKENS = 2048
# a decode holds the planner test's long prompts too (tests/e2e: its streams' KV must fit)
DECODE_KV_TOKENS = 8192
# What only the router uses: deleted under the chart's operator, which must put them back.
ROUTER_OBJECTS = [("deployment", f"{NAME}-router"), ("service", NAME),
                  ("serviceaccount", f"{NAME}-router"), ("role", f"{NAME}-router"),
                  ("rolebinding", f"{NAME}-router")]
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
PLANNER_WINDOW_S = 6
PLAN_S = float(OPERATOR_ENV["BATON_OPERATOR_PLAN_SECONDS"])  # the operator plans this often


@pytest.fixture(scope="module")
def sample(local: LocalCluster) -> Path:
    """The sample as users apply it, with a small KV pool per worker: each would otherwise
    reserve 1.5 GiB for 32k tokens, and the tests' requests need a few hundred."""
    service = yaml.safe_load(SAMPLE.read_text())
    for role, tokens in (("prefill", KV_TOKENS), ("decode", DECODE_KV_TOKENS)):
        service["spec"][role]["args"] = ["--max-total-tokens", str(tokens)]
    # the planner's figures over the last few seconds (60 by default, workers polled every 1 s
    # here): the e2e's loads are short
    service["spec"]["router"]["args"] = ["--planner-window-s", str(PLANNER_WINDOW_S),
                                         "--health-interval-s", "1"]
    path = local.root / "inferenceservice.yaml"
    path.write_text(yaml.safe_dump(service))
    return path


@pytest.fixture(scope="module")
def cluster(local: LocalCluster) -> Cluster:
    """The API as the tests poll it (kubectl does what a user does; polling with it would
    start a process ten times a second)."""
    return Cluster(NS)


def ready(cluster: Cluster) -> bool:
    return cluster.condition(NAME, "Ready").get("status") == "True"


def phase(cluster: Cluster) -> str:
    return str(((cluster.get(NAME) or {}).get("status") or {}).get("phase", ""))


def pods(cluster: Cluster, role: str, name: str = "baton") -> list[dict[str, Any]]:
    """The pool's pods (name "baton"), or the rollout gate's probe pods ("baton-probe")."""
    found = cluster.core.list_namespaced_pod(
        NS, label_selector=f"app.kubernetes.io/name={name},baton.dev/role={role}")
    return list(cluster.client.sanitize_for_serialization(found)["items"])


def router_url(cluster: Cluster) -> str:
    (router,) = pods(cluster, "router")
    return f"http://{router['status']['podIP']}:8000"


def uid(cluster: Cluster, kind: str, name: str) -> str:
    """The uid of a live object ("" when there is none)."""
    rbac = kubernetes.client.RbacAuthorizationV1Api(cluster.client)
    read = {"deployment": cluster.apps.read_namespaced_deployment,
            "service": cluster.core.read_namespaced_service,
            "serviceaccount": cluster.core.read_namespaced_service_account,
            "role": rbac.read_namespaced_role,
            "rolebinding": rbac.read_namespaced_role_binding}[kind]
    try:
        return str(read(name, NS).metadata.uid)
    except kubernetes.client.ApiException as e:
        if e.status == 404:
            return ""
        raise


def ready_decodes(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5, trust_env=False).text
    found = re.search(r'baton_router_ready_workers\{role="decode"\} (\S+)', text)
    return float(found.group(1)) if found else -1.0


def served(pod: dict[str, Any]) -> float:
    """Requests a worker pod finished, from its own /metrics."""
    text = httpx.get(f"http://{pod['status']['podIP']}:8000/metrics", timeout=5,
                     trust_env=False).text
    return sum(float(v) for v in re.findall(r"^baton_requests_total\{[^}]*\} (\S+)", text, re.M))


def chat(base_url: str, model: str, prompt: str, max_tokens: int = 24,
         on_chunk: Callable[[], None] = lambda: None) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) of an openai SDK streamed chat completion."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=120,
                           http_client=httpx.Client(trust_env=False))
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True})
    text, tokens, finish = "", 0, ""
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
            on_chunk()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, tokens, finish


def test_kubectl_apply_ends_in_a_ready_service(local: LocalCluster, cluster: Cluster,
                                               sample: Path) -> None:
    run_kubectl("--validate=false", "apply", "-f", str(REPO / "manifests" / "crd.yaml"),
                namespace=None)
    cluster.create_namespace()  # (the emulated API refuses kubectl's namespace POST)
    watch = subprocess.Popen([str(kubectl()), "-n", NS, "get", "bisvc", "-w"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        run_kubectl("--validate=false", "apply", "-f", str(sample))
        wait_for(lambda: ready(cluster), READY_S,
                 lambda: f"{NAME} Ready; operator log:\n{local.operator_log()}")
    finally:
        watch.terminate()
        output = watch.communicate(timeout=10)[0]
    # Each row of `kubectl get -w` has its own column widths: find the phase by name.
    rows = [re.search(r"\b(Pending|Progressing|Ready|Degraded|Failed)\b", line)
            for line in output.splitlines()[1:]]
    phases = [row.group(1) for row in rows if row]
    distinct = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
    assert distinct == ["Pending", "Progressing", "Ready"], output
    status = (cluster.get(NAME) or {})["status"]
    for role in ("prefill", "decode", "router"):
        assert status[role]["readyReplicas"] == status[role]["replicas"] == 1, status
    assert status["url"] == f"http://{NAME}.{NS}.svc.cluster.local:8000"
    (row,) = table_cells(run_kubectl("get", "bisvc"))
    assert (row["READY"], row["PHASE"], row["PREFILL"], row["DECODE"], row["ROUTER"]) == (
        "True", "Ready", "1", "1", "1"), row
    assert row["URL"] == status["url"]
    ips = [p["status"]["podIP"] for role in ("prefill", "decode", "router")
           for p in pods(cluster, role)]
    assert len(set(ips)) == 3 and all(ip.startswith("127.0.0.") for ip in ips), ips
    # rendered and stored (this one-machine cluster has no CNI to enforce them; what they let
    # through is checked in tests/operator/test_operator_network_policy.py)
    policies = {name for kind, name in cluster.children() if kind == "NetworkPolicy"}
    assert policies == {f"{NAME}-{role}" for role in ("prefill", "decode", "router", "probe")}


def test_streamed_chat_through_the_router_pod_equals_colocated(
        cluster: Cluster, server: ServerProcess) -> None:
    url = router_url(cluster)
    for prompt in PROMPTS:
        got = chat(url, "smollm2-135m", prompt)
        want = chat(server.url, "smollm2", prompt)
        assert got == want and got[1] > 0, prompt
    body = {"text": PROMPTS[0], "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
    got_ids = httpx.post(f"{url}/generate", json=body, timeout=120, trust_env=False).json()
    want_ids = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()
    assert got_ids["output_ids"] == want_ids["output_ids"], (got_ids, want_ids)
    # the pods run with the service's cluster key (its Secret, mounted): a worker takes no
    # room that the router did not sign
    (decode,) = pods(cluster, "decode")
    forged = {**body, "bootstrap_host": "127.0.0.9", "bootstrap_port": 8998, "bootstrap_room": 1}
    r = httpx.post(f"http://{decode['status']['podIP']}:8000/generate", json=forged, timeout=30,
                   trust_env=False)
    assert r.status_code == 401 and r.json()["error"]["code"] == "ticket_required", r.text


def test_decode_scales_out_and_in_without_failing_requests(local: LocalCluster,
                                                            cluster: Cluster) -> None:
    url = router_url(cluster)
    run_kubectl("patch", "bisvc", NAME, "--type=merge", "-p",
                '{"spec":{"decode":{"replicas":2}}}')
    wait_for(lambda: ready_decodes(url) == 2, READY_S, "a second decode in the router")
    decodes = pods(cluster, "decode")
    before = {p["metadata"]["name"]: served(p) for p in decodes}
    for i in range(4):  # round robin: each decode gets two
        assert chat(url, "smollm2-135m", f"Count to {i + 3}.", max_tokens=4)[1] == 4
    after = {p["metadata"]["name"]: served(p) for p in decodes}
    assert all(after[n] > before[n] for n in before), (before, after)

    # Scale in with streams in flight on both decodes: none may fail.
    leaving = max(decodes, key=lambda p: p["metadata"]["creationTimestamp"])
    (process,) = [proc for pod, proc in local.runner.processes()  # type: ignore[union-attr]
                  if pod.name == leaving["metadata"]["name"]]
    results: list[tuple[str, int, str] | BaseException] = []
    started = threading.Semaphore(0)

    def one(i: int) -> None:
        try:
            results.append(chat(url, "smollm2-135m", f"Tell a long story number {i}.",
                                max_tokens=48, on_chunk=started.release))
        except BaseException as e:
            results.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for _ in threads:  # every stream has its first chunk
        assert started.acquire(timeout=60)
    run_kubectl("patch", "bisvc", NAME, "--type=merge", "-p",
                '{"spec":{"decode":{"replicas":1}}}')
    for t in threads:
        t.join(120)
    assert len(results) == 4 and all(isinstance(r, tuple) and r[1:] == (48, "length")
                                     for r in results), results
    wait_for(lambda: ready_decodes(url) == 1, 30, "the router down to one decode")
    assert leaving["metadata"]["name"] not in [
        p["metadata"]["name"] for p in pods(cluster, "decode")]
    wait_for(lambda: not alive({process}), 60, "the leaving decode's process to exit")


class Load:
    """Requests through the router's /generate until stopped: an open loop at `rate` per second
    (a new request every 1/rate s, however many are in flight: what overloads a pool, which a
    closed loop never does), or `rate` None: `clients` closed loops. Each request has a prompt
    of `prompt_tokens` token ids of its own (no prefix cache hit) and makes exactly `tokens`;
    every answer is checked."""

    def __init__(self, url: str, prompt_tokens: int, tokens: int, rate: float | None = None,
                 clients: int = 1) -> None:
        self.url, self.prompt_tokens, self.tokens, self.rate = url, prompt_tokens, tokens, rate
        self.stop = threading.Event()
        self.sent = self.done = 0
        self.failures: list[str] = []
        self.pool = ThreadPoolExecutor(256, thread_name_prefix="load")
        self.pacers = [threading.Thread(target=self._pace, daemon=True)
                       for _ in range(1 if rate is not None else clients)]

    def __enter__(self) -> Load:
        for pacer in self.pacers:
            pacer.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for pacer in self.pacers:
            pacer.join(300)
        self.pool.shutdown(wait=True)  # every request sent gets its answer

    def _pace(self) -> None:
        started = time.monotonic()
        while not self.stop.is_set():
            self.sent += 1
            if self.rate is None:
                self._one(self.sent)
            else:
                self.pool.submit(self._one, self.sent)
                self.stop.wait(max(0.0, started + self.sent / self.rate - time.monotonic()))

    def _one(self, seed: int) -> None:
        seed += int(time.time() * 1000)  # unique across loads too: no prefix cache hit
        ids = [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(self.prompt_tokens)]
        body = {"input_ids": ids, "sampling_params": {
            "temperature": 0, "max_new_tokens": self.tokens, "ignore_eos": True}}
        try:
            r = httpx.post(f"{self.url}/generate", json=body, timeout=300, trust_env=False)
            if r.status_code != 200 or len(r.json()["output_ids"]) != self.tokens:
                self.failures.append(f"{r.status_code}: {r.text[:300]}")
            else:
                self.done += 1
        except httpx.HTTPError as e:
            self.failures.append(f"{type(e).__name__}: {e}")


def planner_status(cluster: Cluster) -> dict[str, Any]:
    return dict(((cluster.get(NAME) or {}).get("status") or {}).get("planner") or {})


def recommended(cluster: Cluster) -> tuple[int, int] | None:
    """(prefill, decode) the planner recommends now; None without a plan."""
    status = planner_status(cluster)
    if "recommended" not in status:
        return None
    return status["prefill"]["recommended"], status["decode"]["recommended"]


def figures(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/debug/planner", timeout=10, trust_env=False).json())


def patch_autoscaling(autoscaling: dict[str, Any]) -> None:
    run_kubectl("patch", "bisvc", NAME, "--type=merge", "-p",
                json.dumps({"spec": {"autoscaling": autoscaling}}))


LONG, SHORT, OUT = 512, 8, 96  # prompt tokens of the prefill-heavy and decode-heavy loads; out


def test_the_planner_recommends_from_the_load_and_then_sizes_the_pools(
        local: LocalCluster, cluster: Cluster) -> None:
    """Loads sized from a calibration (a prefill pod's prompt tokens per second, one prompt at a
    time; a decode pod's tokens per second at four streams), so the test holds on any machine:
    - recommend only (targets, mode metrics): an open loop of long prompts making two tokens
      each at 3x what one prefill pod prefills one at a time recommends 2+ prefill pods, more
      prefill and fewer decode pods than an open loop of short prompts making OUT tokens each
      at 3x what one decode pod decodes at four streams, which recommends 2+ decode pods;
    - mode planner (prefill 1..2, decode 1..1), with a TTFT target no count meets: while
      requests come the prefill pool goes to its max, two pods, and nothing changes over ten
      plans; with the requests gone it is back at one after its cooldown;
    - every request of every load answers in full.
    On this one machine the pods share two cores: an overloaded pool slows the others' forwards
    too, so the targets are generous (only a pool that cannot keep up misses them) and the
    loads' recommendations are compared with each other."""
    url = router_url(cluster)
    with Load(url, LONG, 2) as calibrate:
        wait_for(lambda: calibrate.done >= 3, 120, "calibration requests")
    prefill_s = LONG / figures(url)["prefill_tokens_per_s"]
    with Load(url, SHORT, OUT, clients=4) as calibrate:
        wait_for(lambda: calibrate.done >= 4, 180, "calibration requests")
    steps = figures(url)["decode_steps"]
    decode_tokens_per_s = max(batch / itl for batch, itl in steps)
    targets = {"ttftTarget": max(1, round(3000 * prefill_s)),
               "itlTarget": max(1, round(60000 * min(itl for _, itl in steps)))}
    patch_autoscaling(targets)
    seen: dict[str, Any] = {}

    def plan_under(name: str, load: Load) -> tuple[int, int]:
        """The recommendation once the router's window holds this load alone."""
        with load:
            time.sleep(PLANNER_WINDOW_S + 3 * PLAN_S)
            plan = wait_for(lambda: recommended(cluster), 30,
                            lambda: f"a plan; status.planner {planner_status(cluster)}")
            seen[name] = (planner_status(cluster), figures(url))
        assert not load.failures, load.failures[:3]
        return plan

    # decode-heavy first: its streams outlive the window, whose output lengths then come from
    # the calibration's (the same OUT) as the last seen (runtime/router/figures.py, `stale`)
    d_heavy = plan_under("decode-heavy", Load(url, SHORT, OUT, rate=3 * decode_tokens_per_s / OUT))
    # prompts in a batch prefill faster than one alone: 3x one alone overloads a pod
    p_heavy = plan_under("prefill-heavy", Load(url, LONG, 2, rate=3 / prefill_s))
    assert p_heavy[0] >= 2 and d_heavy[1] >= 2, (p_heavy, d_heavy, seen)
    assert p_heavy[0] > d_heavy[0] and d_heavy[1] > p_heavy[1], (p_heavy, d_heavy, seen)
    (row,) = table_cells(run_kubectl("get", "bisvc", "-o", "wide"))
    assert re.fullmatch(r"\d+:\d+", row["RECOMMENDED"]), row

    # Planner mode, the mechanics: a TTFT target no count of pods meets makes the plan the
    # prefill pool's max whatever the noise, as long as requests come; it returns to the min
    # once they stop (a window without requests) and the cooldown has passed.
    patch_autoscaling({**targets, "ttftTarget": 1, "mode": "planner", "cooldownSeconds": 6,
                       "prefill": {"min": 1, "max": 2}, "decode": {"min": 1, "max": 1}})
    with Load(url, LONG, 2) as steady:
        wait_for(lambda: len([p for p in pods(cluster, "prefill") if pod_ready(p)]) == 2,
                 READY_S, lambda: f"a second prefill; status.planner {planner_status(cluster)}")
        replicas = set()
        for _ in range(10):  # ten plans with the load going on: the pools stay
            time.sleep(PLAN_S)
            status = planner_status(cluster)
            replicas.add((status["prefill"]["replicas"], status["decode"]["replicas"],
                          len(pods(cluster, "prefill"))))
        assert replicas == {(2, 1, 2)}, (replicas, planner_status(cluster))
    assert not steady.failures, steady.failures[:3]
    wait_for(lambda: len(pods(cluster, "prefill")) == 1, 120,
             lambda: f"back to one prefill; status.planner {planner_status(cluster)}")
    condition = cluster.condition(NAME, "Autoscaling")
    assert (condition["status"], condition["reason"]) == ("True", "Planner"), condition
    run_kubectl("patch", "bisvc", NAME, "--type=json", "-p",
                '[{"op": "remove", "path": "/spec/autoscaling"}]')
    wait_for(lambda: cluster.condition(NAME, "Autoscaling") == {} and not planner_status(cluster),
             30, "autoscaling off")
    wait_for(lambda: ready(cluster), READY_S, "Ready again")


ROLL_PROMPTS = ["Name three colours.", "What is two plus two?", "Say hello in French."]
ROLL_TOKENS = 12


def rollout(cluster: Cluster) -> dict[str, Any]:
    return dict(((cluster.get(NAME) or {}).get("status") or {}).get("rollout") or {})


def ready_by_revision(cluster: Cluster) -> dict[tuple[str, str], int]:
    """Ready serving pods by (role, revision)."""
    counts: dict[tuple[str, str], int] = {}
    for role in ("prefill", "decode"):
        for pod in pods(cluster, role):
            if pod_ready(pod):
                key = (role, pod["metadata"]["labels"]["baton.dev/revision"])
                counts[key] = counts.get(key, 0) + 1
    return counts


class Streams:
    """`clients` closed loops of streamed chats through the router until stopped, each
    compared with the colocated server's answer to its prompt."""

    def __init__(self, url: str, expected: dict[str, tuple[str, int, str]], clients: int = 2
                 ) -> None:
        self.url, self.expected = url, expected
        self.done = 0
        self.failures: list[tuple[Any, ...]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(clients)]

    def __enter__(self) -> Streams:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)

    def _loop(self, i: int) -> None:
        while not self.stop.is_set():
            prompt = ROLL_PROMPTS[(i + self.done) % len(ROLL_PROMPTS)]
            try:
                got = chat(self.url, "smollm2-135m", prompt, max_tokens=ROLL_TOKENS)
                if got != self.expected[prompt]:
                    self.failures.append((prompt, got, self.expected[prompt]))
            except Exception as e:  # every error counts, none may happen
                self.failures.append((prompt, repr(e)))
            self.done += 1


def scale_to(local: LocalCluster, cluster: Cluster, prefills: int, decodes: int) -> None:
    run_kubectl("patch", "bisvc", NAME, "--type=merge", "-p", json.dumps(
        {"spec": {"prefill": {"replicas": prefills}, "decode": {"replicas": decodes}}}))
    wait_for(lambda: ready(cluster) and [len(pods(cluster, r)) for r in ("prefill", "decode")]
             == [prefills, decodes] and all(pod_ready(p) for r in ("prefill", "decode")
                                           for p in pods(cluster, r)), READY_S,
             lambda: f"{prefills}P+{decodes}D ready; operator log:\n{local.operator_log()}")
    url = router_url(cluster)
    wait_for(lambda: ready_decodes(url) == decodes, 60, f"{decodes} decodes in the router")


@pytest.mark.timeout(600)
def test_a_revision_whose_prefill_corrupts_kv_is_stopped_by_the_gate(
        local: LocalCluster, cluster: Cluster, server: ServerProcess) -> None:
    """At 2P+2D, a spec whose prefills negate an element of every KV page they send
    (`--perturb kv_before_send`): the operator probes a pair of that revision with the token
    oracle and the KV canary, the probe fails, Progressing=False/ProbeFailed names it, and the
    old revision serves every request throughout, exactly; reverting the spec ends it."""
    scale_to(local, cluster, 2, 2)
    serving = rollout(cluster)["revision"]
    url = router_url(cluster)
    expected = {p: chat(server.url, "smollm2", p, max_tokens=ROLL_TOKENS) for p in ROLL_PROMPTS}
    args = ["--max-total-tokens", str(KV_TOKENS)]
    bad = [*args, "--perturb", "kv_before_send=1", "--perturb-warmup-steps", "0"]
    with Streams(url, expected) as streams:
        run_kubectl("patch", "bisvc", NAME, "--type=merge", "-p",
                    json.dumps({"spec": {"prefill": {"args": bad}}}))
        failed = wait_for(lambda: cluster.condition(NAME, "Progressing").get("reason")
                          == "ProbeFailed" and cluster.condition(NAME, "Progressing"), READY_S,
                          lambda: f"ProbeFailed; rollout {rollout(cluster)}; operator log:\n"
                                  f"{local.operator_log()}")
        done = streams.done
        wait_for(lambda: streams.done >= done + 2, 120, "requests after the verdict")
    assert not streams.failures and streams.done >= 4, streams.failures[:3]
    print(f"\ngate: {streams.done} streams exact while it probed; Progressing: {failed['message']}")
    assert failed["status"] == "False"
    assert "probe 1: 5 prompt tokens" in failed["message"] and "KV canary" in failed["message"], (
        failed)
    state = rollout(cluster)
    assert (state["phase"], state["gate"]) == ("ProbeFailed", "failed") and (
        state["revision"] != serving), state
    assert set(ready_by_revision(cluster)) == {("prefill", serving), ("decode", serving)}
    wait_for(lambda: not pods(cluster, "prefill", "baton-probe") and not pods(
        cluster, "decode", "baton-probe"), 60, "the probe pods gone")
    assert ready(cluster), "the old revision serves: Ready stays True"
    (row,) = table_cells(run_kubectl("get", "bisvc"))
    assert row["ROLLOUT"] == "ProbeFailed", row
    # reverting the spec makes the serving revision the target again: nothing to roll
    run_kubectl("patch", "bisvc", NAME, "--type=merge", "-p",
                json.dumps({"spec": {"prefill": {"args": args}}}))
    wait_for(lambda: rollout(cluster).get("phase") == "Stable"
             and rollout(cluster).get("revision") == serving, 30, "back to the serving revision")
    assert cluster.condition(NAME, "Progressing")["reason"] == "Complete"


@pytest.mark.timeout(600)
def test_a_new_revision_rolls_out_in_step_under_streams(
        local: LocalCluster, cluster: Cluster, server: ServerProcess) -> None:
    """2P+2D and two clients streaming all along, a spec change of both pools' revision: the
    gate probes a pair of it, then the pools roll in step, two steps of one pod each. On
    every poll the router's pairs are each of one revision, and each revision's ready pods
    in the two pools are within maxSkew (50%) of each other; no stream fails and every one
    equals the colocated server's. In the end only the new revision is left."""
    scale_to(local, cluster, 2, 2)
    old = rollout(cluster)["revision"]
    url = router_url(cluster)
    expected = {p: chat(server.url, "smollm2", p, max_tokens=ROLL_TOKENS) for p in ROLL_PROMPTS}
    phases: list[str | None] = []
    timeline: list[tuple[Any, ...]] = []  # (seconds, phase, step, prefill, decode) on changes
    revisions_paired: set[str] = set()
    skews: list[tuple[float, dict[tuple[str, str], int]]] = []

    def sample_pairs() -> None:
        """Every pair the router formed is of one revision (a side that has left shows None:
        its revision was seen while it served)."""
        for pair in httpx.get(f"{url}/debug/pairs", timeout=10, trust_env=False).json()["pairs"]:
            sides = (pair["prefill_revision"], pair["decode_revision"])
            if None not in sides:
                assert sides[0] == sides[1], pair
                revisions_paired.add(sides[0])

    with Streams(url, expected) as streams:
        run_kubectl("patch", "bisvc", NAME, "--type=merge", "-p", json.dumps(
            {"spec": {"decode": {"env": [{"name": "BATON_E2E_ROLLOUT", "value": "1"}]}}}))
        began = time.monotonic()
        deadline = began + 480
        while time.monotonic() < deadline:
            state = rollout(cluster)
            if not phases or phases[-1] != state.get("phase"):
                phases.append(state.get("phase"))
            moment = (state.get("phase"), state.get("step"), state.get("prefill"),
                      state.get("decode"))
            if not timeline or timeline[-1][1:] != moment:
                timeline.append((round(time.monotonic() - began, 1), *moment))
            sample_pairs()
            counts = ready_by_revision(cluster)
            new = state.get("revision")
            if new != old:  # each revision's ready P:D (shares of 2 pods per pool)
                skew = max(abs(counts.get(("prefill", rev), 0) - counts.get(("decode", rev), 0))
                           / 2 for rev in (old, new))
                skews.append((skew, counts))
                assert skew <= 0.5, counts
            if (new != old and state.get("phase") == "Stable"
                    and set(counts) == {("prefill", new), ("decode", new)}):
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"the rollout did not finish: {rollout(cluster)}; phases "
                                 f"{phases}; operator log:\n{local.operator_log()}")
        done, settled = streams.done, time.monotonic() - began
        wait_for(lambda: sample_pairs() or streams.done >= done + 2, 120,
                 "requests on the new revision")
        print(f"\nsettled at {settled:.1f} s, 2 more streams by {time.monotonic() - began:.1f} s")
    assert not streams.failures, streams.failures[:3]
    print(f"\nrollout: {time.monotonic() - began:.0f} s, phases {phases}, {streams.done} streams "
          f"exact, {len(skews)} polls, largest skew {max(s for s, _ in skews):.2f}, pairs of "
          f"revisions {sorted(revisions_paired)}")
    for moment in timeline:
        print("  ", *moment)
    assert streams.done >= 6, streams.done
    assert phases[-3:] == ["Probing", "RollingOut", "Stable"], phases
    assert {old, new} <= revisions_paired, revisions_paired  # both served, never mixed
    assert max(skew for skew, _ in skews) <= 0.5
    assert rollout(cluster)["gate"] == "passed"
    assert ready_by_revision(cluster) == {("prefill", new): 2, ("decode", new): 2}
    assert not [name for kind, name in cluster.children() if kind == "Deployment"
                and old in name], "the old revision's Deployments deleted"
    scale_to(local, cluster, 1, 1)


def test_a_tensor_parallel_decode_pool_answers(local: LocalCluster, cluster: Cluster,
                                               server: ServerProcess) -> None:
    """spec.decode.tensorParallelSize 3 (the builtin's 9 heads and 3 KV heads: one KV head a
    rank): the new decode pod runs three ranks, the router pairs it with the one-rank prefill,
    each prefill page goes to the three decode ranks by head over nixl, and a streamed chat
    through the router equals the colocated server's. `kubectl get bisvc -o wide` shows each
    pool's TP."""
    # a new revision of both pools, rolled in step (without the gate here: the two tests
    # before this one are about it)
    run_kubectl("patch", "bisvc", NAME, "--type=merge", "-p",
                '{"spec":{"decode":{"tensorParallelSize":3},"rollout":{"gate":"none"}}}')

    def rolled() -> bool:
        svc = cluster.get(NAME) or {}
        status = svc.get("status") or {}
        decodes = pods(cluster, "decode")
        return (status.get("observedGeneration") == svc["metadata"]["generation"] and ready(cluster)
                and len(decodes) == 1 and "--tp" in decodes[0]["spec"]["containers"][0]["args"]
                and all(status[r]["updatedReplicas"] == status[r]["replicas"] == 1
                        for r in ("prefill", "decode")))

    wait_for(rolled, READY_S, lambda: f"the TP decode rolled out; operator log:\n{local.operator_log()}")
    (decode,) = pods(cluster, "decode")
    (pid,) = [p for pod, p in local.runner.processes()  # type: ignore[union-attr]
              if pod.name == decode["metadata"]["name"]]
    ranks = [p for p in descendants(pid)
             if b"runtime.scheduler.ranks" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(ranks) == 2, f"decode followers: {ranks}"
    url = router_url(cluster)
    wait_for(lambda: httpx.get(f"{url}/ready", trust_env=False).status_code == 200, 60,
             "router ready")
    for prompt in PROMPTS:
        got = chat(url, "smollm2-135m", prompt)
        assert got == chat(server.url, "smollm2", prompt) and got[1] > 0, prompt
    pairs = httpx.get(f"{url}/debug/pairs", timeout=10, trust_env=False).json()["pairs"]
    assert any((p["prefill_tp"], p["decode_tp"]) == (1, 3) and p["succeeded"] >= len(PROMPTS)
               for p in pairs), pairs
    (row,) = table_cells(run_kubectl("get", "bisvc", "-o", "wide"))
    assert (row["PREFILL-TP"], row["DECODE-TP"], row["KV"]) == ("1", "3", "nixl"), row


def test_a_killed_prefill_is_restarted_and_the_service_recovers(local: LocalCluster,
                                                                 cluster: Cluster) -> None:
    (prefill,) = pods(cluster, "prefill")
    name = prefill["metadata"]["name"]
    (pid,) = [p for pod, p in local.runner.processes() if pod.name == name]  # type: ignore[union-attr]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: phase(cluster) == "Degraded", 30,
             lambda: f"phase Degraded; operator log:\n{local.operator_log()}")
    assert cluster.condition(NAME, "Degraded")["reason"] == "PodsLost"
    wait_for(lambda: (pods(cluster, "prefill")[0]["status"]["containerStatuses"][0]
                      ["restartCount"] == 1), 30, "restartCount 1")
    wait_for(lambda: ready(cluster), READY_S,
             lambda: f"Ready again; prefill log:\n{local.pod_log(NS, name)}")
    assert pods(cluster, "prefill")[0]["metadata"]["name"] == name, "restarted in place"
    url = router_url(cluster)
    wait_for(lambda: httpx.get(f"{url}/ready", trust_env=False).status_code == 200, 30,
             "router ready")
    assert chat(url, "smollm2-135m", PROMPTS[0], max_tokens=8)[1] == 8


def test_the_helm_rendered_operator_takes_over_and_reconciles(local: LocalCluster,
                                                              cluster: Cluster) -> None:
    """The chart's Deployment, RBAC and CRD from `helm template`, applied with kubectl: the
    pod runner runs the operator pod (its rendered args, its ServiceAccount's RBAC). It takes
    the running service over and puts back the router's objects deleted by hand; the new
    router pod serves."""
    assert local.stop_operator() == 0, local.operator_log()
    rendered = subprocess.run(
        [str(helm()), "template", "baton", str(REPO / "charts" / "baton"), "--namespace",
         "baton-system", "--include-crds"], capture_output=True, text=True, check=True).stdout
    manifest = local.root / "chart.yaml"
    manifest.write_text(rendered)
    Cluster("baton-system").create_namespace()
    run_kubectl("--validate=false", "apply", "-f", str(manifest), namespace=None)
    operator = wait_for(lambda: _running_pod("baton-system", "operator"), 30, "operator pod")
    assert operator["spec"]["serviceAccountName"] == "baton-operator"

    def log() -> str:
        return local.pod_log("baton-system", operator["metadata"]["name"])

    before = {obj: uid(cluster, *obj) for obj in ROUTER_OBJECTS}
    run_kubectl("delete", *(f"{kind}/{name}" for kind, name in ROUTER_OBJECTS))
    wait_for(lambda: all(uid(cluster, *obj) not in ("", before[obj]) for obj in ROUTER_OBJECTS),
             30, lambda: f"the router's objects back; the chart's operator's log:\n{log()}")
    router = uid(cluster, "deployment", f"{NAME}-router")
    wait_for(lambda: [p["metadata"]["ownerReferences"][0]["uid"]
                      for p in pods(cluster, "router")] == [router], 30, "the new router pod")
    # the new router pod ready (Ready may still be True from before it was replaced)
    wait_for(lambda: ready(cluster) and all(pod_ready(p) for p in pods(cluster, "router")),
             READY_S, lambda: f"Ready under the chart's operator; its log:\n{log()}")
    url = router_url(cluster)
    wait_for(lambda: httpx.get(f"{url}/ready", trust_env=False).status_code == 200, 30,
             "the new router ready")
    assert chat(url, "smollm2-135m", PROMPTS[0], max_tokens=8)[1] == 8


def test_deleting_the_service_removes_every_child_and_process(local: LocalCluster) -> None:
    everything = _pod_processes(local, NS)
    assert everything
    run_kubectl("delete", "bisvc", NAME, timeout=60)
    kinds = "deployments,services,pods,serviceaccounts,roles,rolebindings"
    wait_for(lambda: run_kubectl("get", kinds, "-o", "name").split() in (
        [], ["serviceaccount/default"]), 30, "no child objects")
    wait_for(lambda: not alive(everything), 90, "every pod process gone")


def _running_pod(namespace: str, component: str) -> dict[str, Any] | None:
    out = run_kubectl("get", "pods", "-l", f"app.kubernetes.io/component={component}",
                      "-o", "yaml", namespace=namespace)
    for pod in yaml.safe_load(out)["items"]:
        if (pod.get("status") or {}).get("phase") == "Running":
            return dict(pod)
    return None


def _pod_processes(local: LocalCluster, namespace: str | None = None) -> set[int]:
    """Every process of the cluster's pods (in `namespace`), their children included."""
    assert local.runner is not None
    pids = {pid for pod, pid in local.runner.processes()
            if namespace is None or pod.namespace == namespace}
    return pids | {child for pid in pids for child in descendants(pid)}
