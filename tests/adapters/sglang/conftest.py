import pytest

# A submodule: in another environment, `import sglang` can find this very folder (a namespace package).
pytest.importorskip("sglang.srt", reason="runs in the sglang environment: scripts/test_engines.sh sglang")
