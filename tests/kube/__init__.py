"""The emulated Kubernetes API (kmock plus our compatibility layer), a real kubectl and helm,
and the helpers the operator tests (tests/operator) and the local cluster (tests/e2e) share."""
