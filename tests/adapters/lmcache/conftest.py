"""Fixtures for the LMCache plug-in tests: LMCache's storage loop and its CPU backend."""

import pytest
# A submodule: in another environment, `import lmcache` can find this very folder (a namespace package).
pytest.importorskip("lmcache.v1", reason="runs in the lmcache environment: scripts/test_engines.sh lmcache")

import asyncio  # noqa: E402
import threading  # noqa: E402

from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402

from lmcache_helpers import engine_config, engine_metadata  # noqa: E402


@pytest.fixture
def lmcache_loop():
    """An event loop in its own thread, as LMCache runs its storage loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.fixture
def cpu_backend():
    """LMCache's LocalCPUBackend on CPU: its allocator makes the MemoryObjs, as in a worker."""
    return LocalCPUBackend(engine_config(), engine_metadata(), dst_device="cpu")
