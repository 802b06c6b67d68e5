"""Every object each Kustomize tree renders is valid against the Kubernetes API's schemas
(the `kubernetes-validate` package carries them, pinned in pyproject's test extra), strictly:
a misspelt or misplaced field is an error, not a field the API server drops."""

import copy

import kubernetes_validate
import pytest
from manifests import TREES, daemon_set, render

# The oldest Kubernetes these manifests are for (every field they use is GA there:
# internalTrafficPolicy, startupProbe, seccompProfile) and the newest the package knows.
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.latest_version())


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("tree", TREES)
def test_every_rendered_object_is_valid_for_the_kubernetes_api(tree, version):
    objects = render(tree)
    assert objects, f"{tree} renders nothing"
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{tree}: {obj['kind']} {obj['metadata']['name']}: {exc.message} "
                                 f"at {'/'.join(map(str, exc.path))}") from None


def test_a_misspelt_or_mistyped_field_fails_the_validation():
    """The check above can fail: a field the API does not have, or a mode given as a string."""
    for path, key, value in ((("containers", 0), "imagePulPolicy", "IfNotPresent"),
                             (("volumes", 0, "configMap"), "defaultMode", "0400")):
        bad = copy.deepcopy(daemon_set(render("base")))
        node = bad["spec"]["template"]["spec"]
        for step in path:
            node = node[step]
        node[key] = value
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, KUBERNETES_VERSIONS[0], strict=True)
