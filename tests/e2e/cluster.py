"""A Kubernetes cluster on one machine, for the whole path `kubectl apply` → tokens.

    python -m tests.e2e.cluster up --kubeconfig /tmp/local.kubeconfig
    kubectl --kubeconfig /tmp/local.kubeconfig --validate=false apply -f manifests/crd.yaml
    (the same with the sample in namespace serving: see docs/local-cluster.md)

Three parts, in the foreground until Ctrl-C or SIGTERM (which stop everything: pods, operator,
API; every process it starts also gets SIGKILL from the kernel if this one dies):
- the API: the emulated API server of the operator tests (tests/kube: kmock plus our layer:
  RBAC by ServiceAccount token, watches, label selectors, garbage collection, status/scale
  subresources), on a random loopback port; the kubeconfig written is an administrator's;
- the operator: `baton operator --all-namespaces --standalone`, its own process (optional:
  a test may instead run the one `helm template` renders, as a pod);
- the pod runner (tests/e2e/runner.py and pod.py): kubelet plus the Deployment controller.
  Each pod is a local process running the container's command and args exactly as rendered.

How pods share one machine without rewriting anything: each pod gets its own loopback
address 127.0.0.x (all of 127.0.0.0/8 works on Linux without set-up) as `status.podIP`, and
a wildcard bind inside the pod (`--host 0.0.0.0`) is narrowed to that address by a start-up
hook on the pod's PYTHONPATH (tests/e2e/netns/sitecustomize.py), which is what the pod's
network namespace does in a cluster. So every pod keeps its container ports (8000, 8998),
the args are the operator's, and the runtime's own rules (POD_IP as the advertised address)
are what is tested.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from runtime.lifecycle import die_with_parent
from tests.e2e.runner import PodRunner
from tests.kube.isvc_helpers import wait_for
from tests.kube.kmock_cluster import EmulatedCluster
from tests.kube.operator_process import healthy
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
# Fast reactions for a test cluster; a real deployment keeps the operator's defaults.
OPERATOR_ENV = {"BATON_OPERATOR_RETRY_SECONDS": "1", "BATON_OPERATOR_PLAN_SECONDS": "0.5"}


class LocalCluster:
    """The emulated API, optionally the operator, and the pod runner (see the module doc)."""

    def __init__(self, root: Path, kubeconfig: Path, operator: bool = True,
                 probe_period: float = 0.5, grace_cap: float | None = None) -> None:
        self.root, self.kubeconfig = root, kubeconfig
        self.with_operator, self.probe_period, self.grace_cap = operator, probe_period, grace_cap
        self.api = EmulatedCluster()
        self.operator: subprocess.Popen[bytes] | None = None
        self.runner: PodRunner | None = None

    @contextmanager
    def running(self) -> Iterator[LocalCluster]:
        self.root.mkdir(parents=True, exist_ok=True)
        with self.api.running():
            self.kubeconfig.write_text(self.api.kubeconfig())
            self.runner = PodRunner(self.api.url, self.root / "pods", probe_period=self.probe_period,
                                    grace_cap=self.grace_cap).start()
            try:
                if self.with_operator:
                    self.start_operator()
                yield self
            finally:
                self.stop_operator()
                self.runner.stop()

    def start_operator(self) -> None:
        """`baton operator` for every namespace, as an administrator, until stop_operator."""
        liveness = f"http://127.0.0.1:{free_port()}/healthz"
        log = (self.root / "operator.log").open("ab")
        env = {**os.environ, **OPERATOR_ENV, "KUBECONFIG": str(self.kubeconfig),
               "PYTHONPATH": f"{REPO}:{REPO / 'operator'}"}  # this checkout, operator too
        self.operator = subprocess.Popen(
            [sys.executable, "-m", "runtime.cli", "operator", "--all-namespaces", "--standalone",
             f"--liveness={liveness}"], env=env, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_us)
        log.close()
        wait_for(lambda: healthy(liveness) or self.operator.poll() is not None,  # type: ignore[union-attr]
                 60, "the operator's liveness endpoint")
        assert self.operator.poll() is None, self.operator_log()

    def stop_operator(self, timeout: float = 20) -> int | None:
        """SIGTERM; its exit code (None if none was running)."""
        if self.operator is None:
            return None
        proc, self.operator = self.operator, None
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(10)

    def operator_log(self) -> str:
        path = self.root / "operator.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def pod_log(self, namespace: str, name: str) -> str:
        path = self.root / "pods" / namespace / name / "container.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


def _die_with_us() -> None:
    die_with_parent(signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e.cluster",
                                     description="a local Kubernetes cluster for baton")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the API, the operator and the pod runner")
    up.add_argument("--kubeconfig", type=Path, required=True, help="where to write it")
    up.add_argument("--root", type=Path, default=None,
                    help="logs and pod folders (default: a new temporary folder)")
    up.add_argument("--no-operator", action="store_true",
                    help="do not start `baton operator` (apply the chart's Deployment instead)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("httpx", "aiohttp.access", "kmock"):  # one line per API request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    root = args.root or Path(tempfile.mkdtemp(prefix="baton-cluster-"))
    stop = threading.Event()

    def on_signal(sig: int, _: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with LocalCluster(root, args.kubeconfig.resolve(), operator=not args.no_operator).running():
        print(f"cluster up: API {args.kubeconfig}, logs and pods under {root}\n"
              f"  export KUBECONFIG={args.kubeconfig.resolve()}\n"
              "  kubectl --validate=false apply -f manifests/crd.yaml\n"
              "  kubectl --validate=false apply -f - <<< '{\"apiVersion\":\"v1\",\"kind\":\"Namespace\","
              "\"metadata\":{\"name\":\"serving\"}}'\n"
              "  kubectl -n serving --validate=false apply -f "
              "manifests/samples/inferenceservice.yaml\n"
              "  kubectl -n serving get bisvc,pods -o wide -w\n"
              "Ctrl-C stops everything.", flush=True)
        stop.wait()
        print("stopping: pods, operator, API", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
