"""Every PromQL expression baton ships, against a REAL Prometheus (Debian's `prometheus`
package, which brings `promtool`): the alert rules pass `promtool check rules`, and a
Prometheus scraping a real `baton up` (router, prefill, decode; the builtin SmolLM2) under
load returns data for every dashboard panel, adapter rule and KEDA trigger query, and
evaluates every alert without error. Skipped cleanly when the binaries are absent (install:
`apt-get install prometheus`; docs/operator.md "Watching it" has the command)."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.monitoring.prometheus_process import (
    Prometheus,
    Target,
    binary,
    finite_values,
    running_prometheus,
)
from tests.monitoring.queries import LOCAL, RULES, alert_signals, all_queries
from tests.up_process import Up

READY_LINE = re.compile(r"\] (\S+) ready at (http://\S+)")
# one long shared opening (several KV pages), so the prefix cache has something to hit
OPENING = ("You are a helpful assistant who answers in one short sentence, plainly, without "
           "lists, headings or code, and who never repeats the question back to the user. ")
PROMPTS = [OPENING + q for q in ("Tell me a story about a fox.", "List three colours.",
                                 "What is the capital of France?", "Why is the sky blue?")]
LOAD_S = 12  # a dozen 1 s scrapes: every rate() has its samples
CLIENTS = 4
# alert signals with no series in a healthy local run: counters that exist once something
# failed, and the operator's, which is not running here (tests/operator/test_operator_metrics.py)
QUIET = {"alert signal: BatonKVTransferFailures", "alert signal: BatonRouterUpstreamFailures",
         "alert signal: BatonOperatorReconcileErrors", "alert signal: BatonServiceNotReady"}


def test_promtool_checks_the_alert_rules(tmp_path: Path) -> None:
    promtool = binary("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    ok = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True,
                        text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"SUCCESS: {RULES.read_text().count('- alert:')} rules found" in ok.stdout
    broken = tmp_path / "broken.yaml"
    broken.write_text(RULES.read_text().replace("(baton_kv_usage_ratio)", "(baton_kv_usage_ratio",
                                                1))
    bad = subprocess.run([promtool, "check", "rules", str(broken)], capture_output=True)
    assert bad.returncode != 0  # promtool does refuse a broken expression


def targets(up: Up) -> list[Target]:
    """Router, prefill and decode, labelled as a PodMonitor (podTargetLabels) labels them."""
    found = [Target(up.url, {"pod": "router-0", "baton_dev_role": "router"})]
    found += [Target(url, {"pod": name, "baton_dev_role": name.split("-")[0]})
              for name, url in READY_LINE.findall(up.text()) if name != "router"]
    for t in found:
        t.labels.update(namespace=LOCAL["namespace"], app_kubernetes_io_instance=LOCAL["instance"])
    return found


def load(url: str, stop: threading.Event, errors: list[str]) -> None:
    with httpx.Client(base_url=url, timeout=120) as http:
        i = 0
        while not stop.is_set():
            body = {"model": "smollm2-135m", "prompt": PROMPTS[i % len(PROMPTS)],
                    "max_tokens": 12, "stream": i % 2 == 0}
            r = http.post("/v1/completions", json=body)
            if r.status_code != 200:
                errors.append(r.text[:200])
            i += 1


@pytest.fixture
def baton_up(model_path: Path, tmp_path: Path) -> Iterator[Up]:
    """`baton up` as `make run` starts it (the model_path fixture prepares the model); only
    when there is a Prometheus to scrape it."""
    if binary("prometheus") is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    up = Up("builtin:smollm2-135m", tmp_path, "--kv-transfer", "tcp")
    try:
        up.wait_up()
        yield up
    finally:
        up.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_query_returns_data_from_a_real_prometheus(baton_up: Up, tmp_path: Path) -> None:
    scraped = targets(baton_up)
    assert sorted(t.labels["baton_dev_role"] for t in scraped) == ["decode", "prefill", "router"]
    (tmp_path / "prom").mkdir()
    with running_prometheus(scraped, tmp_path / "prom") as prom:
        stop, errors = threading.Event(), []  # type: ignore[var-annotated]
        clients = [threading.Thread(target=load, args=(baton_up.url, stop, errors))
                   for _ in range(CLIENTS)]
        started = time.monotonic()
        for c in clients:
            c.start()
        try:
            time.sleep(LOAD_S)
            assert len(prom.targets_up()) == len(scraped), prom.targets_up()
        finally:
            stop.set()
            for c in clients:
                c.join(180)
        assert not errors, errors[:3]
        time.sleep(3)  # a last scrape after the load
        report = check_all(prom)
        print(f"\nreal Prometheus: {len(report)} queries after {time.monotonic() - started:.0f} s "
              f"of load; each: series, first finite value")
        for line in report:
            print("  " + line)


def check_all(prom: Prometheus) -> list[str]:
    report, failures = [], []
    for q in all_queries() + alert_signals():
        answer = prom.query(q.expr)
        if answer.get("status") != "success":
            failures.append(f"{q.where}: {answer.get('error')} in {q.expr}")
            continue
        series = answer["data"]["result"]
        values = finite_values(answer)
        report.append(f"{q.where}: {len(series)} series, "
                      f"{values[0] if values else '-'}")
        if q.alert or q.where in QUIET:
            continue  # an alert's condition holds data only while it fires
        if not values:
            failures.append(f"{q.where}: no data ({len(series)} series, none finite) for "
                            f"{q.expr}")
    assert not failures, "\n".join(failures)
    return report
