import pytest

pytest.importorskip("sglang", reason="runs in the sglang environment: scripts/test_engines.sh sglang")
