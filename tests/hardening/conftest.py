"""Fixtures of the hardening tests: daemons with raw TOML configs, cleaned up after.

Tests marked `slow` (the long soak) run only when asked for: `pytest -m slow tests/hardening`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hardening_support import DaemonProc

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if "slow" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if item.get_closest_marker("slow") is not None and HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture
def make_daemon():
    made = []

    def make(config: dict | None = None, extra_toml: str = "", arena_bytes: str = "16MiB",
             start: bool = True) -> DaemonProc:
        d = DaemonProc(config, extra_toml, arena_bytes)
        made.append(d)
        return d.start() if start else d

    yield make
    for d in made:
        d.cleanup()
