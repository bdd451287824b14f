"""A real Prometheus server (Debian's `prometheus` package) on loopback, scraping static
targets with the labels a PodMonitor would give them, queried through its HTTP API."""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.ports import free_port


@dataclass(frozen=True)
class Target:
    url: str  # http://127.0.0.1:PORT
    labels: dict[str, str]


def binary(name: str) -> str | None:
    return shutil.which(name)


def config(targets: list[Target], interval: str = "1s") -> dict[str, Any]:
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [{"job_name": "baton", "metrics_path": "/metrics",
                                "static_configs": [
                                    {"targets": [t.url.removeprefix("http://")],
                                     "labels": t.labels} for t in targets]}]}


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=30)

    def query(self, expr: str) -> dict[str, Any]:
        """The API's answer to an instant query (raises on an HTTP error other than 400/422,
        which carry PromQL errors in the body)."""
        r = self.http.get("/api/v1/query", params={"query": expr})
        if r.status_code not in (200, 400, 422):
            r.raise_for_status()
        return dict(r.json())

    def targets_up(self) -> list[str]:
        answer = self.http.get("/api/v1/targets").json()
        return [t["scrapeUrl"] for t in answer["data"]["activeTargets"] if t["health"] == "up"]


def finite_values(answer: dict[str, Any]) -> list[float]:
    values = [float(series["value"][1]) for series in answer["data"]["result"]]
    return [v for v in values if not math.isnan(v)]


@contextmanager
def running_prometheus(targets: list[Target], workdir: Path) -> Iterator[Prometheus]:
    exe = binary("prometheus")
    assert exe is not None
    cfg = workdir / "prometheus.yml"
    cfg.write_text(yaml.safe_dump(config(targets)))
    port = free_port()
    log = (workdir / "prometheus.log").open("wb")
    proc = subprocess.Popen([exe, f"--config.file={cfg}",
                             f"--storage.tsdb.path={workdir / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (workdir / "prometheus.log").read_text()
            try:
                if prom.http.get("/-/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus not ready in 60 s"
            time.sleep(0.2)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()
        prom.http.close()
