"""Fixtures of the pool tests: a real mooncake_master on loopback, and a keeper lending the
pool its memory (tests/mooncake_helpers.py)."""

import tempfile

import pytest

from mooncake_helpers import Keeper, Master, mooncake_or_skip


@pytest.fixture
def master():
    exe = mooncake_or_skip()
    with tempfile.TemporaryDirectory(prefix="mc-") as workdir:
        m = Master(exe, workdir).start()
        yield m
        m.kill()


@pytest.fixture
def keeper(master):
    k = Keeper(master)
    yield k
    k.stop()
