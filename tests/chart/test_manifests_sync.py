"""manifests/ is generated from the chart (charts/manifests.py) and must not drift."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from chart_support import K8S_VERSIONS, load_docs, validate_builtin

from charts import manifests

pytestmark = pytest.mark.timeout(120)  # each test renders with the Helm engine


def test_manifests_match_a_fresh_render():
    assert manifests.drifted() == [], "run `python charts/manifests.py`"
    assert manifests.main(["--check"]) == 0


def test_check_detects_drift_and_write_repairs_it(tmp_path, capsys):
    out = tmp_path / "manifests"
    shutil.copytree(manifests.MANIFESTS_DIR, out)
    operator_yaml = out / "operator.yaml"
    operator_yaml.write_text(operator_yaml.read_text().replace("replicas: 1", "replicas: 3"))
    (out / "crd.yaml").unlink()

    assert manifests.main(["--check", "--out", str(out)]) == 1
    assert "crd.yaml is out of date" in capsys.readouterr().err
    assert manifests.drifted(out) == ["crd.yaml", "operator.yaml"]

    assert manifests.main(["--out", str(out)]) == 0
    assert manifests.main(["--check", "--out", str(out)]) == 0


def test_crd_manifest_is_the_charts_crd(crd):
    assert load_docs((manifests.MANIFESTS_DIR / "crd.yaml").read_text()) == [crd]


def test_operator_manifest(render):
    docs = load_docs((manifests.MANIFESTS_DIR / "operator.yaml").read_text())
    assert [d["kind"] for d in docs] == [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "NetworkPolicy",
    ]
    assert docs[0]["metadata"]["name"] == "baton-system"
    for doc in docs:
        validate_builtin(doc)
        labels = doc["metadata"]["labels"]
        assert "helm.sh/chart" not in labels and "app.kubernetes.io/managed-by" not in labels
        if doc["kind"] in ("ServiceAccount", "Deployment", "NetworkPolicy"):
            assert doc["metadata"]["namespace"] == "baton-system"
    # apart from the Helm-only labels, the objects are exactly what the chart renders
    helm_only = ("helm.sh/chart", "app.kubernetes.io/managed-by")
    rendered = render(name=manifests.RELEASE_NAME, namespace=manifests.NAMESPACE)
    for obj in rendered:
        for meta in (obj["metadata"], obj.get("spec", {}).get("template", {}).get("metadata", {})):
            for key in helm_only:
                meta.get("labels", {}).pop(key, None)
    assert sorted(rendered, key=str) == sorted(docs[1:], key=str)


def test_validate_builtin_rejects_an_invalid_object():
    bad = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "x"}, "secrets": 1}
    with pytest.raises(AssertionError, match="invalid for Kubernetes"):
        validate_builtin(bad)
    assert len(K8S_VERSIONS) == 2


def test_manifests_module_imports_without_torch_or_helm():
    code = (
        "import sys, charts.manifests; "
        "assert 'torch' not in sys.modules and 'helm_python' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=manifests.REPO_ROOT)
