"""The tests here score the daemon's KV events with Dynamo's indexer, in Dynamo's environment."""

import pytest

pytest.importorskip("dynamo.llm", reason="runs in the dynamo environment: scripts/test_engines.sh dynamo")
