"""client.gpu: the engine's mapping of the daemon's GPU tier buffer.

On CPU: the argument checks and the copy itself over a CPU tensor standing in for the mapped
buffer, and the map-once-per-process bookkeeping with CUDA's two calls stood in for. The gpu
test maps a real GpuTier's export in a second process (CUDA refuses to open an IPC handle in
the process that exported it) and reads copies GpuCopies put there, bit-exact."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import subprocess
import sys
import types
import weakref

import numpy as np
import pytest
import torch

import kvstore.client.gpu as client_gpu
from kvstore.client.gpu import GpuMapping, local_device_index
from kvstore.client import AsyncClient
from kvstore.errors import InvalidArgument, ServiceError
from kvstore.replies import GpuHandleReply

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA = torch.cuda.is_available()


def handle(**changes) -> GpuHandleReply:
    fields = dict(device=0, handle=b"h" * 64, storage_bytes=1 << 20, storage_offset_bytes=0,
                  ref_counter_handle=b"/torch_1_2", ref_counter_offset=3, event_handle=b"e" * 64,
                  event_sync_required=True, capacity_bytes=1 << 20, device_uuid=None)
    return GpuHandleReply(**{**fields, **changes})


@pytest.fixture
def mapping():
    return GpuMapping.over(torch.arange(4096, dtype=torch.int64).to(torch.uint8))


def test_importing_the_gpu_client_does_not_import_torch():
    code = "import sys, kvstore.client.gpu, kvstore.client; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr


def test_copy_to_lands_the_extent_at_the_front_of_any_contiguous_tensor(mapping):
    out = torch.full((4, 8), -1.0, dtype=torch.float16)  # 64 bytes
    assert mapping.copy_to(out, 1000, 40) == 40
    raw = out.reshape(-1).view(torch.uint8)
    assert raw[:40].tolist() == [(1000 + i) % 256 for i in range(40)]
    assert bytes(raw[40:].numpy()) == np.full(12, -1.0, np.float16).tobytes()  # the rest untouched
    assert mapping.view(1000, 40).tolist() == raw[:40].tolist()


@pytest.mark.parametrize("out, offset, size, match", [
    (torch.empty(64, dtype=torch.uint8, device="meta"), 0, 16, "out is on meta"),
    (torch.empty(8, 8, dtype=torch.uint8).t(), 0, 16, "not contiguous"),
    (torch.empty(3, dtype=torch.float32), 0, 16, "is 16 bytes, out only 12"),
    (np.empty(64, np.uint8), 0, 16, "must be a torch.Tensor"),
    (torch.empty(64, dtype=torch.uint8), 4090, 16, r"extent \(4090, 16\) is not inside"),
    (torch.empty(64, dtype=torch.uint8), -1, 16, "is not inside"),
    (torch.empty(64, dtype=torch.uint8), 0, 0, "is not inside"),
])
def test_copy_to_refuses_outputs_it_cannot_fill(mapping, out, offset, size, match):
    with pytest.raises(InvalidArgument, match=match):
        mapping.copy_to(out, offset, size)


def test_a_closed_mapping_says_so(mapping):
    mapping.close()
    mapping.close()
    with pytest.raises(InvalidArgument, match="closed"):
        mapping.view(0, 1)


def test_a_mapping_needs_a_gpu_handle_reply_that_fits_its_export():
    with pytest.raises(InvalidArgument, match="GpuHandleReply"):
        GpuMapping({"device": 0})
    with pytest.raises(InvalidArgument, match="exceeds the exported"):
        GpuMapping(handle(capacity_bytes=2 << 20))


@pytest.mark.skipif(CUDA, reason="checks a process without CUDA")
def test_without_cuda_the_mapping_says_what_to_do():
    with pytest.raises(ServiceError, match="sees no CUDA device"):
        local_device_index(handle())


def fake_cuda(monkeypatch, uuids):
    """torch.cuda as a process that sees these devices would report them (no GPU here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=uuids[i]))


def test_the_daemons_device_is_found_by_uuid_under_another_numbering(monkeypatch):
    fake_cuda(monkeypatch, ["aaaa-1", "bbbb-2"])
    assert local_device_index(handle(device=0, device_uuid="GPU-BBBB-2")) == 1
    assert local_device_index(handle(device=1)) == 1  # no uuid: the daemon's index as it is
    with pytest.raises(ServiceError, match="CUDA_VISIBLE_DEVICES hides it"):
        local_device_index(handle(device_uuid="cccc-3"))
    with pytest.raises(ServiceError, match="sees 2 device"):
        local_device_index(handle(device=2))


def test_one_process_maps_an_export_once_and_returns_later_exports_references(monkeypatch):
    opened, released = [], []

    def open_ipc_buffer(h, device):
        opened.append((h.ref_counter_offset, device))
        return torch.zeros(h.storage_bytes, dtype=torch.uint8)

    fake_cuda(monkeypatch, ["aaaa"])
    monkeypatch.setattr(client_gpu, "_MAPPED", weakref.WeakValueDictionary())  # a fresh process's
    monkeypatch.setattr(client_gpu, "_EXPORTS_SEEN", set())
    monkeypatch.setattr(client_gpu, "open_ipc_buffer", open_ipc_buffer)
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda",
                        lambda name, offset: released.append((name, offset)), raising=False)
    first = GpuMapping(handle(ref_counter_offset=1, capacity_bytes=4096))
    second = GpuMapping(handle(ref_counter_offset=2, capacity_bytes=4096))  # another client's export
    assert opened == [(1, 0)] and released == [(b"/torch_1_2", 2)]
    GpuMapping(handle(ref_counter_offset=2))  # the same reply again: its reference is back already
    assert released == [(b"/torch_1_2", 2)]
    first.view(0, 4).fill_(9)
    assert second.view(0, 4).tolist() == [9] * 4 and second.capacity_bytes == 4096
    del first, second
    gc.collect()
    GpuMapping(handle(ref_counter_offset=3))  # nobody maps it any more: mapped afresh
    assert opened == [(1, 0), (3, 0)] and len(released) == 1


def test_a_daemon_without_a_gpu_tier_refuses_gpu_handle_and_keeps_serving(daemon_factory):
    daemon = daemon_factory()
    with daemon.client() as c:
        with pytest.raises(InvalidArgument, match="runs no GPU tier"):
            c.gpu_handle()  # InvalidArgument: "this daemon runs no GPU tier"
        assert "gpu" in c.stats()  # the connection still serves

    async def from_asyncio():
        async with await AsyncClient.connect(daemon.socket) as c:
            with pytest.raises(InvalidArgument, match="runs no GPU tier"):
                await c.gpu_handle()
            return await c.stats()
    assert "gpu" in asyncio.run(from_asyncio())


def _engine(wire: dict, extents: list, results) -> None:
    """A second process, as an engine: map the daemon's export, copy each extent out."""
    try:
        mapping = GpuMapping(GpuHandleReply.from_wire(wire))
        again = GpuMapping(GpuHandleReply.from_wire(wire))
        got = []
        for offset, size in extents:
            out = torch.empty((size + 1) // 2, dtype=torch.float16, device=mapping.device)
            mapping.copy_to(out, offset, size)
            got.append(out.view(torch.uint8)[:size].cpu().numpy().tobytes())
        assert again.view(*extents[0]).data_ptr() == mapping.view(*extents[0]).data_ptr()  # mapped once
        try:
            mapping.copy_to(torch.empty(16, dtype=torch.uint8), *extents[0])
        except InvalidArgument as exc:
            got.append(str(exc))
        results.put(got)
    except BaseException as exc:  # report it: the parent asserts on what comes back
        results.put(f"{type(exc).__name__}: {exc}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_an_engine_process_reads_gpu_copies_bit_exact_through_the_mapping():
    from kvstore.config import GpuConfig
    from kvstore.tiers.gpu import GpuTier
    from kvstore.tiers.gpu_copies import GpuCopies

    tier = GpuTier(GpuConfig(enabled=True, capacity_bytes=1 << 20))
    copies = GpuCopies(tier)
    rng = np.random.default_rng(4)
    objects = {bytes([i]) * 32: rng.integers(0, 256, size, dtype=np.uint8) for i, size in enumerate((1, 4095, 70001))}
    extents = []
    for digest, data in objects.items():
        copies.copy_in("t", digest, memoryview(data), data.size)
        extents.append((copies.acquire("t", digest).offset, data.size))
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    engine = ctx.Process(target=_engine, args=(tier.ipc_handle().to_wire(), extents, results))
    engine.start()
    got = results.get(timeout=120)
    engine.join(60)
    assert isinstance(got, list), got
    assert got[:3] == [data.tobytes() for data in objects.values()]
    assert "out is on cpu" in got[3]
    for digest in objects:
        copies.release("t", digest)
    copies.check_integrity()
    tier.close()


def test_get_into_device_from_a_daemon_without_a_gpu_tier_copies_the_host_lease(daemon_factory):
    from kvs_testing import payload
    daemon = daemon_factory()
    with daemon.client() as c:
        data = payload(10_000, 3)
        key = b"h" * 32
        c.put(key, data)
        out = torch.zeros(5_000, dtype=torch.float16)  # any dtype: bytes land at its front
        assert c.get_into_device(key, out) == data.size
        assert np.array_equal(out.view(torch.uint8).numpy(), data)
        assert c.core.gpu_mapping is False  # asked once: this daemon runs none
        assert c.get_into_device(b"\x01" * 32, out) is None  # a miss
        with pytest.raises(InvalidArgument, match="larger tensor"):
            c.get_into_device(key, torch.zeros(16, dtype=torch.uint8))
        assert c.get(key) is not None  # every lease was released; the connection serves on


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_get_into_device_reads_the_daemons_device_copy(daemon_factory):
    from kvs_testing import payload
    daemon = daemon_factory(config={"gpu": {"enabled": True, "capacity_bytes": "64MiB"}})
    with daemon.client() as c:
        data = payload(1 << 20, 4)
        key = b"g" * 32
        c.put(key, data)
        out = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        for _ in range(2):  # the first read makes the copy, the second reuses it
            assert c.get_into_device(key, out) == data.size
            assert np.array_equal(out.cpu().numpy(), data)
        gpu = c.stats()["gpu"]
        assert gpu["num_copies_in"] == 1 and gpu["num_gpu_hits"] == 2 and gpu["readers"] == 0, gpu
        c.check_integrity()


@pytest.mark.skipif(CUDA, reason="the case of a process without CUDA")
def test_a_client_without_cuda_reads_from_the_host_even_where_the_daemon_runs_a_gpu_tier():
    """The daemon exports its buffer, but this process cannot map it (no CUDA here): the get
    goes out without gpu, so the daemon answers with a host lease."""
    asked = []

    class Core:  # the ClientCore calls op_get_into_device makes, answered as a GPU daemon would
        gpu_mapping = None

        def op_simple(self, msg):
            return handle()
            yield  # a generator, like ClientCore's ops

        def op_get(self, key, namespace, accept, ranges, expect, gpu=False):
            asked.append(gpu)
            return None  # a miss ends the call here
            yield

    core = Core()
    run = client_gpu.op_get_into_device(core, b"k" * 32, torch.zeros(4), None)
    with pytest.raises(StopIteration) as stop:
        next(run)
    assert stop.value.value is None and asked == [False] and core.gpu_mapping is False
