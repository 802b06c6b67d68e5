"""The client pins each arena it maps for CUDA where the process uses CUDA (client/pinning.py).
Without a GPU here, a stand-in torch module plays the CUDA runtime's part; the real runtime
is exercised by the gpu-marked test (scripts/gpu_check.sh)."""

import gc
import sys
import types

import numpy as np
import pytest

from kvstore.client.pinning import clear_last_cuda_error
from kvstore.identity import ObjectId

KEY = ObjectId(bytes(range(32)))
DATA = np.arange(8192, dtype=np.uint8)


def fake_torch(register, unregister=lambda address: 0):
    runtime = types.SimpleNamespace(cudaHostRegister=register, cudaHostUnregister=unregister)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True, cudart=lambda: runtime))


def put_and_read_pinning(daemon) -> tuple[str, np.ndarray]:
    with daemon.client() as c:
        c.put(KEY, DATA)
        with c.get(KEY) as lease:
            assert np.array_equal(lease.numpy(), DATA)
        return c.core.pinned[c.namespace], c.core.arenas[c.namespace]


def test_without_torch_in_the_process_nothing_is_pinned_and_torch_is_not_imported(daemon, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    said, _ = put_and_read_pinning(daemon)
    assert said == "not pinned: torch is not imported in this process"


def test_the_whole_arena_is_registered_at_its_own_address(daemon, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "torch", fake_torch(lambda address, size, flags: calls.append(
        (address, size, flags)) or 0))
    said, arena = put_and_read_pinning(daemon)
    assert calls == [(arena.ctypes.data, arena.size, 1)]  # portable: every CUDA context
    assert said == f"pinned {arena.size} bytes for CUDA (DMA copies)"


def test_the_range_is_unregistered_when_the_last_lease_view_of_the_arena_is_gone(daemon, monkeypatch):
    registered, unregistered = [], []
    monkeypatch.setitem(sys.modules, "torch", fake_torch(
        lambda address, size, flags: registered.append(address) or 0, unregistered.append))
    big = np.arange(256 << 10, dtype=np.uint8)  # past the size that get() copies: a zero-copy lease
    with daemon.client() as c:
        c.put(KEY, big)
        lease = c.get(KEY)
        view = lease.numpy()
        assert np.array_equal(view, big)
    # the client is closed; an array taken from a lease still views the arena: still registered
    gc.collect()
    assert len(registered) == 1 and unregistered == []
    del lease, view
    gc.collect()
    assert unregistered == registered  # before the mapping goes: the next one can be pinned


@pytest.mark.parametrize("register, why", [
    (lambda address, size, flags: 801, "cudaHostRegister failed with CUDA error 801"),
    (lambda address, size, flags: 1 / 0, "ZeroDivisionError"),
])
def test_a_failing_registration_leaves_a_working_unpinned_arena(daemon, monkeypatch, register, why):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(register))
    said, _ = put_and_read_pinning(daemon)
    assert said.startswith("not pinned: ") and why in said


@pytest.mark.gpu
def test_a_cuda_process_pins_the_arena_and_reads_leases_by_dma(daemon):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    said, arena = put_and_read_pinning(daemon)
    assert said.startswith("pinned "), said
    assert torch.from_numpy(arena).is_pinned()
    again = torch.cuda.cudart().cudaHostRegister(arena.ctypes.data, arena.size, 1)
    assert int(again) == 712  # cudaErrorHostMemoryAlreadyRegistered: it is pinned
    clear_last_cuda_error()  # else torch's next kernel launch reports 712 as its own
    assert torch.zeros(16, device="cuda").sum().item() == 0
    with daemon.client() as c, c.get(KEY) as lease:
        on_device = torch.from_numpy(lease.numpy()).to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_device.cpu(), torch.from_numpy(DATA))


@pytest.mark.gpu
def test_daemons_used_in_turn_are_each_pinned_and_cuda_stays_clean(daemon_factory):
    """An arena mapped where an earlier one was (its client closed, its leases gone) is pinned
    again: the earlier range was unregistered, and no failed call leaves an error behind."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for _ in range(3):
        said, arena = put_and_read_pinning(daemon_factory())
        assert said.startswith("pinned "), said
        del arena
        gc.collect()
        assert torch.zeros(16, device="cuda").sum().item() == 0
