"""tests/kubernetes: the manifests under deploy/kubernetes, rendered with `kubectl kustomize`.
Every test here renders them, so each skips, saying why, where kubectl is absent."""

import pytest
from manifests import kubectl_missing


def pytest_collection_modifyitems(items):
    reason = kubectl_missing()
    if reason:
        for item in items:
            if "tests/kubernetes/" in str(item.path):
                item.add_marker(pytest.mark.skip(reason=reason))
