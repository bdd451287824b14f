"""Generate manifests/ from the Helm chart, so the two never drift (a dev script, not part of
the operator: `python charts/manifests.py`).

charts/baton is the one source of truth. This module renders it with the real Helm engine
(helm-python-sdk, offline) for release "baton" in namespace "baton-system" and writes

  manifests/crd.yaml       the chart's crds/ file, verbatim under a "generated" header
  manifests/operator.yaml  Namespace + the rendered ServiceAccount, ClusterRole(Binding), Deployment

The two labels that only make sense under Helm (`helm.sh/chart`,
`app.kubernetes.io/managed-by: Helm`) are dropped from the plain manifests; nothing else changes.
manifests/samples/ is hand-written and not generated.

    python charts/manifests.py           # rewrite manifests/
    python charts/manifests.py --check   # exit 1 when manifests/ differ from the chart

Imports neither torch nor helm_python at module level (helm is loaded when rendering).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
CHART_DIR = REPO_ROOT / "charts" / "baton"
MANIFESTS_DIR = REPO_ROOT / "manifests"
RELEASE_NAME = "baton"
NAMESPACE = "baton-system"

# Order objects so `kubectl apply -f` creates dependencies first.
KIND_ORDER = ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
              "RoleBinding", "Deployment")
HELM_ONLY_LABEL = re.compile(r"^\s*(helm\.sh/chart|app\.kubernetes\.io/managed-by):.*\n", re.M)


def _header(source: str) -> str:
    return (
        f"# GENERATED from {source} by `python charts/manifests.py`. Do not edit:\n"
        "# change the chart and regenerate (tests/chart checks that this file matches).\n"
    )


def render_chart(
    values: dict[str, Any] | None = None,
    *,
    name: str = RELEASE_NAME,
    namespace: str = NAMESPACE,
    chart_dir: Path = CHART_DIR,
) -> dict[str, str]:
    """Render the chart's templates: template path -> YAML text (NOTES.txt and empty output
    left out). Raises helm_python's HelmValuesError when values.schema.json rejects `values`."""
    import helm_python as helm

    with helm.Chart.load(chart_dir) as chart:
        rendered = chart.render(values or {}, name=name, namespace=namespace)
    return {
        path: text
        for path, text in sorted(rendered.items())
        if not path.endswith("NOTES.txt") and yaml.safe_load(text) is not None
    }


def chart_crds(chart_dir: Path = CHART_DIR) -> list[str]:
    """The raw text of each file under the chart's crds/ as Helm loads it, in file-name order."""
    import helm_python as helm

    with helm.Chart.load(chart_dir) as chart:
        return [crd["data"] for crd in sorted(chart.crds, key=lambda crd: crd["filename"])]


def _namespace_doc(namespace: str) -> str:
    return (
        "apiVersion: v1\n"
        "kind: Namespace\n"
        "metadata:\n"
        f"  name: {namespace}\n"
        "  labels:\n"
        "    app.kubernetes.io/name: baton\n"
        "    app.kubernetes.io/part-of: baton\n"
    )


def _kind_rank(doc: str) -> int:
    kind = yaml.safe_load(doc)["kind"]
    return KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)


def generate(chart_dir: Path = CHART_DIR) -> dict[str, str]:
    """File name (relative to manifests/) -> the content it must have."""
    crds = "---\n".join(chart_crds(chart_dir))
    docs = [
        HELM_ONLY_LABEL.sub("", text).strip("\n") + "\n"
        for text in render_chart(chart_dir=chart_dir).values()
    ]
    docs.append(_namespace_doc(NAMESPACE))
    docs.sort(key=_kind_rank)
    return {
        "crd.yaml": _header("charts/baton/crds/") + crds,
        "operator.yaml": _header("charts/baton (helm template, defaults)") + "---\n".join(docs),
    }


def drifted(out_dir: Path = MANIFESTS_DIR, chart_dir: Path = CHART_DIR) -> list[str]:
    """Names of the generated files that are missing from `out_dir` or differ from the chart."""
    wanted = generate(chart_dir)
    return [
        name
        for name, text in wanted.items()
        if not (out_dir / name).is_file() or (out_dir / name).read_text() != text
    ]


def write(out_dir: Path = MANIFESTS_DIR, chart_dir: Path = CHART_DIR) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in generate(chart_dir).items():
        path = out_dir / name
        path.write_text(text)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python charts/manifests.py",
        description="Generate manifests/ from the Helm chart.",
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if manifests/ drifted from the chart"
    )
    parser.add_argument("--chart", type=Path, default=CHART_DIR, help="chart directory")
    parser.add_argument("--out", type=Path, default=MANIFESTS_DIR, help="manifests directory")
    args = parser.parse_args(argv)
    if args.check:
        stale = drifted(args.out, args.chart)
        for name in stale:
            print(
                f"{args.out / name} is out of date; run `python charts/manifests.py`",
                file=sys.stderr,
            )
        return 1 if stale else 0
    for path in write(args.out, args.chart):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
