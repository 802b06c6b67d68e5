"""GPU tier: a clear 'unavailable' without CUDA, device memory and CUDA IPC with it."""

from __future__ import annotations

import pickle
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import kvstore.tiers.gpu as gpu_tier
from kvstore.config import GpuConfig
from kvstore.errors import InvalidArgument, ServiceError
from kvstore.replies import GpuHandleReply
from kvstore.tiers.allocator import Extent
from kvstore.tiers.gpu import GpuTier

ROOT = Path(__file__).resolve().parents[2]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")


@no_cuda
def test_probe_reports_why_the_tier_is_absent(monkeypatch):
    monkeypatch.setattr(gpu_tier, "_device_nodes", lambda: ["/dev/nvidia0"])  # past the quick check
    availability = GpuTier.probe()
    assert availability.available is False and availability.num_devices == 0
    assert "CPU-only" in availability.reason or "no CUDA device" in availability.reason


@no_cuda
def test_probe_without_a_device_node_answers_without_torch(monkeypatch):
    monkeypatch.setattr(gpu_tier, "_device_nodes", lambda: [])
    monkeypatch.setitem(sys.modules, "torch", None)  # importing torch would now fail
    availability = GpuTier.probe()
    assert not availability.available and "no NVIDIA device" in availability.reason


@no_cuda
def test_opening_without_cuda_raises_service_error_with_the_reason():
    with pytest.raises(ServiceError, match="gpu tier unavailable: ") as raised:
        GpuTier(GpuConfig(enabled=True, capacity_bytes=1 << 20))
    assert GpuTier.probe().reason in str(raised.value)


def test_probe_survives_driver_bindings_that_raise(monkeypatch):
    # cuda-python without libcuda raises from cuInit instead of returning an error code
    def cu_init(flags):
        raise RuntimeError("libcuda.so.1: cannot open shared object file")

    driver = types.SimpleNamespace(cuInit=cu_init)
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = driver
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_tier, "_device_nodes", lambda: ["/dev/nvidia0"])
    availability = GpuTier.probe()
    assert not availability.available and "no usable driver" in availability.reason


def test_config_rejects_nonsense():
    with pytest.raises(InvalidArgument):
        GpuConfig(capacity_bytes=0)
    with pytest.raises(InvalidArgument, match="multiple of 256"):
        GpuConfig(capacity_bytes=1000)
    with pytest.raises(InvalidArgument, match="gpu.device"):
        GpuConfig(device=-1)
    assert GpuConfig(capacity_bytes="64MiB").capacity_bytes == 64 << 20


_READER = """
import pickle, sys
sys.path.insert(0, sys.argv[1])
from kvstore.client.gpu import open_ipc_buffer
from kvstore.replies import GpuHandleReply
buf = open_ipc_buffer(GpuHandleReply.from_wire(pickle.loads(sys.stdin.buffer.read())))
print(int(buf[:4096].sum()), flush=True)
buf[4096:8192].fill_(7)
import torch; torch.cuda.synchronize()
"""


@pytest.mark.gpu
def test_engine_maps_the_tier_buffer_by_cuda_ipc():
    tier = GpuTier(GpuConfig(enabled=True, capacity_bytes=1 << 20))
    first, second = tier.alloc(4096), tier.alloc(4096)
    assert (first.offset, second.offset) == (0, 4096)
    tier.view(first).fill_(1)
    tier.view(second).zero_()
    torch.cuda.synchronize()
    handle = tier.ipc_handle()
    assert isinstance(handle, GpuHandleReply) and handle.storage_bytes >= 1 << 20
    assert handle.capacity_bytes == 1 << 20 and handle.device_uuid == tier.device_uuid
    wire = handle.to_wire()
    done = subprocess.run([sys.executable, "-c", _READER, str(ROOT)], input=pickle.dumps(wire),
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    assert int(done.stdout.decode().split()[0]) == 4096  # the engine saw the tier's bytes
    assert int(tier.view(second).sum()) == 7 * 4096  # and the tier sees the engine's
    with pytest.raises(InvalidArgument):
        tier.view(Extent((1 << 20) - 256, 512))
    tier.free(first)
    tier.check_integrity()
    assert tier.alloc(100) == Extent(0, 256)
    tier.close()
    tier.close()
    assert tier.closed
