"""One local cluster per module (tests/e2e/cluster.py): the API, the operator, the pod runner."""

from __future__ import annotations

from collections.abc import Iterator

import kubernetes
import pytest

from tests.e2e.cluster import LocalCluster


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """The cluster, with $KUBECONFIG pointing at it for kubectl and the kubernetes client."""
    root = tmp_path_factory.mktemp("cluster")
    kubeconfig = root / "kubeconfig"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KUBECONFIG", str(kubeconfig))
        # The kubernetes client read $KUBECONFIG at import time.
        mp.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION",
                   str(kubeconfig))
        with LocalCluster(root, kubeconfig).running() as cluster:
            yield cluster
