"""One pod of the local cluster: its container run as a local process, the way kubelet would.

What a pod gets here, and how it differs from a node:
- its own address `status.podIP` = 127.0.0.x; a wildcard bind in the pod listens there only
  (netns/sitecustomize.py stands in for the pod's network namespace), so every pod keeps the
  container ports it declares and the rendered args run as written;
- `command` (else the image's entrypoint, `baton`) + `args`, with `$(VAR)` expanded from its env as kubelet does; the image is this
  machine's installation (`baton` from the running interpreter's folder), and the image's own
  environment is IMAGE_ENV plus $PATH/$PYTHONPATH;
- `env` values, and `valueFrom.fieldRef` of status.podIP, status.hostIP, metadata.name,
  metadata.namespace, spec.serviceAccountName (the downward API);
- an emptyDir for each such volume: a fresh folder, and for a secret volume a folder with a
  file per key of the Secret, read from the API; with no mount namespace, an env value under a
  mountPath (HOME=/tmp, BATON_CLUSTER_KEY_FILE=/etc/baton/...) is pointed into that folder;
- its ServiceAccount's token as $KUBECONFIG (kubelet mounts it under
  /var/run/secrets/kubernetes.io/serviceaccount, which cannot be mounted here), unless
  automountServiceAccountToken is false;
- restartPolicy Always: a container that exits is started again (restartCount + 1) on the
  same address; SIGTERM on deletion, SIGKILL for the whole process group after
  terminationGracePeriodSeconds.
Refused with a clear message (the pod stays not ready): init containers, more than one
container, volumes other than emptyDir and secret, env from Secrets or ConfigMaps.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from runtime.lifecycle import die_with_parent

NETNS = Path(__file__).resolve().parent / "netns"
REPO = Path(__file__).resolve().parents[2]
IMAGE_ENTRYPOINT = ["baton"]  # the Dockerfile's ENTRYPOINT, for containers that give only args
SA_TOKEN_PREFIX = "serviceaccount:"  # how the emulated API authenticates a ServiceAccount


class Unsupported(Exception):
    """What this runner cannot run, named."""


def image_env() -> dict[str, str]:
    """The environment the 'image' brings: this machine's installation and caches."""
    cache = os.environ.get("BATON_CACHE") or str(Path.home() / ".cache" / "baton")
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions")
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    return {
        "PATH": path,
        "PYTHONPATH": f"{NETNS}:{REPO}:{REPO / 'operator'}",  # this checkout, operator too
        "PYTHONUNBUFFERED": "1",
        "BATON_CACHE": cache,  # the image bakes the builtin model there
        "TORCH_EXTENSIONS_DIR": extensions,  # and would bake the compiled CPU kernel
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


@dataclass
class Pod:
    """A Pod object's local life: its process, readiness and restarts."""

    namespace: str
    name: str
    owner: str  # the Deployment's name
    template_hash: str
    ip: str
    spec: dict[str, Any]
    api_url: str
    root: Path
    created: float = field(default_factory=time.monotonic)
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    ready: bool = False
    failures: int = 0  # readiness probes failed in a row
    refused: str = ""  # why it cannot run here
    kill_at: float | None = None  # set once it is being deleted
    started_at: float = 0.0

    @property
    def container(self) -> dict[str, Any]:
        return dict(self.spec["containers"][0])

    @property
    def log(self) -> Path:
        return self.root / "container.log"

    def start(self) -> None:
        """Start (or restart) the container's process."""
        try:
            cmd, env = self._command()
        except Unsupported as e:
            self.refused = str(e)
            return
        self.root.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            out.write(f"--- start {time.strftime('%H:%M:%S')}: {' '.join(cmd)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(cmd, env=env, cwd=self.root, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_runner)
        self.started_at = time.monotonic()
        self.ready, self.failures = False, 0

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def probe(self, client: httpx.Client) -> None:
        """kubelet's readiness probe (httpGet on a named or numbered port); a container that
        is not running is not ready."""
        if not self.running():
            self.ready = False
            return
        probe = self.container.get("readinessProbe")
        if not probe:
            self.ready = True
            return
        get = probe["httpGet"]
        url = f"http://{self.ip}:{self._port(get['port'])}{get.get('path', '/')}"
        try:
            ok = 200 <= client.get(url, timeout=1.0).status_code < 400
        except httpx.HTTPError:
            ok = False
        self.failures = 0 if ok else self.failures + 1
        if ok:
            self.ready = True
        elif self.failures >= int(probe.get("failureThreshold", 3)):
            self.ready = False

    def terminate(self, grace_cap: float | None = None) -> None:
        """SIGTERM now; SIGKILL for the process group after the grace period."""
        grace = float(self.spec.get("terminationGracePeriodSeconds", 30))
        if grace_cap is not None:
            grace = min(grace, grace_cap)
        self.kill_at = time.monotonic() + grace
        self.ready = False
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)

    def reap(self, force: bool = False) -> bool:
        """After `terminate`: whether everything of the pod is gone (SIGKILL when due)."""
        assert self.kill_at is not None
        if self.running() and not force and time.monotonic() < self.kill_at:
            return False
        self.kill_group()
        return True

    def kill_group(self) -> None:
        """SIGKILL whatever is left of the container (kubelet kills its cgroup)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def status(self) -> dict[str, Any]:
        """The Pod's `status` as kubelet reports it."""
        running = self.running()
        ready = "True" if self.ready and running else "False"
        if self.refused:
            state: dict[str, Any] = {"waiting": {"reason": "Unsupported", "message": self.refused}}
        elif running:
            state = {"running": {}}
        else:
            code = self.proc.returncode if self.proc is not None else None
            state = {"waiting": {"reason": "ContainerCreating" if code is None else "Restarting"}}
        image = self.container.get("image", "")
        container_id = {"containerID": f"local://{self.proc.pid}"} if running and self.proc else {}
        return {
            "phase": "Running" if running else "Pending",
            "podIP": self.ip, "podIPs": [{"ip": self.ip}], "hostIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": ready},
                           {"type": "ContainersReady", "status": ready},
                           {"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [{"name": self.container["name"], "ready": ready == "True",
                                   "restartCount": self.restarts, "started": running,
                                   "image": image, "imageID": f"local://{image}",
                                   **container_id, "state": state}],
        }

    # -- the container's command line and environment ----------------------------------

    def _command(self) -> tuple[list[str], dict[str, str]]:
        if self.spec.get("initContainers"):
            raise Unsupported("init containers (a model that is not builtin:) are not run by "
                              "the local pod runner")
        if len(self.spec.get("containers") or []) != 1:
            raise Unsupported("the local pod runner runs pods of exactly one container")
        volumes = self._volumes()
        env = {**image_env(), "LOCAL_CLUSTER_POD_IP": self.ip}
        for var in self.container.get("env") or []:
            env[var["name"]] = self._env_value(var, env, volumes)
        env.update(self._service_account())
        command = self.container.get("command") or IMAGE_ENTRYPOINT
        words = [*command, *self.container.get("args", [])]
        return [_expand(word, env) for word in words], env

    def _volumes(self) -> dict[str, Path]:
        """mountPath -> the folder that stands for it."""
        kinds = {}
        for volume in self.spec.get("volumes") or []:
            if "secret" in volume:
                kinds[volume["name"]] = self._secret_volume(volume)
            elif "emptyDir" in volume:
                kinds[volume["name"]] = self.root / "volumes" / volume["name"]
            else:
                raise Unsupported(f"volume {volume['name']}: only emptyDir and secret volumes "
                                  "are supported")
        mounts = {}
        for mount in self.container.get("volumeMounts") or []:
            folder = kinds[mount["name"]]
            folder.mkdir(parents=True, exist_ok=True)
            mounts[mount["mountPath"]] = folder
        return mounts

    def _secret_volume(self, volume: Mapping[str, Any]) -> Path:
        """A folder with one file per key of the Secret, as kubelet projects it (the Secret
        must exist: kubelet too waits for it)."""
        source = volume["secret"]
        answer = httpx.get(f"{self.api_url}/api/v1/namespaces/{self.namespace}/secrets/"
                           f"{source['secretName']}", headers={"Authorization": "Bearer runner"},
                           timeout=10, trust_env=False)
        if answer.status_code != 200:
            raise Unsupported(f"volume {volume['name']}: secret {source['secretName']} is not "
                              f"readable yet ({answer.status_code})")
        folder = self.root / "volumes" / volume["name"]
        folder.mkdir(parents=True, exist_ok=True)
        for key, value in (answer.json().get("data") or {}).items():
            path = folder / key
            path.write_bytes(base64.b64decode(value))
            path.chmod(int(source.get("defaultMode", 0o644)))
        return folder

    def _env_value(self, var: Mapping[str, Any], env: Mapping[str, str],
                   mounts: Mapping[str, Path]) -> str:
        if "valueFrom" in var:
            ref = var["valueFrom"].get("fieldRef")
            if ref is None:
                raise Unsupported(f"env {var['name']}: only fieldRef values are supported")
            fields = {"status.podIP": self.ip, "status.hostIP": "127.0.0.1",
                      "metadata.name": self.name, "metadata.namespace": self.namespace,
                      "spec.serviceAccountName": self._account()}
            return fields[ref["fieldPath"]]
        value = _expand(str(var.get("value", "")), env)
        for path, folder in sorted(mounts.items(), key=lambda m: -len(m[0])):
            if value == path or value.startswith(path.rstrip("/") + "/"):
                return str(folder) + value[len(path.rstrip("/")):]
        return value

    def _account(self) -> str:
        return str(self.spec.get("serviceAccountName") or "default")

    def _service_account(self) -> dict[str, str]:
        if self.spec.get("automountServiceAccountToken") is False:
            return {}
        config = self.root / "serviceaccount.kubeconfig"
        token = f"{SA_TOKEN_PREFIX}{self.namespace}:{self._account()}"
        config.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: local, cluster: {{server: \"{self.api_url}\"}}}}]\n"
            f"users: [{{name: sa, user: {{token: \"{token}\"}}}}]\n"
            "contexts: [{name: local, context: {cluster: local, user: sa, "
            f"namespace: {self.namespace}}}}}]\ncurrent-context: local\n")
        return {"KUBECONFIG": str(config)}

    def _port(self, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in self.container.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise Unsupported(f"probe port {port!r} is not a container port")


def _expand(word: str, env: Mapping[str, str]) -> str:
    """kubelet's `$(VAR)` expansion (`$$(VAR)` stays literal; unknown names stay as written)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), word)


def _die_with_runner() -> None:
    die_with_parent(signal.SIGKILL)
