"""GpuCopies: the GPU tier's index of device copies. One suite, two devices: a numpy buffer
behind the real ExtentAllocator (the only stand-in: this machine has no GPU), and the real
GpuTier on CUDA (marked gpu; scripts/gpu_check.sh runs it on a lent GPU machine)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstore.config import GpuConfig
from kvstore.errors import InvalidArgument
import kvs_testing
from kvs_testing import NumpyDevice
from kvstore.identity import ObjectId
from kvstore.tiers.allocator import Extent
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.gpu_copies import GpuCopies

UNIT = 1024  # one test object; the tier holds CAPACITY // UNIT of them
CAPACITY = 4 * UNIT
CUDA = GpuTier.probe().available


@pytest.fixture(params=["numpy", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")])])
def device(request):
    if request.param == "numpy":
        yield NumpyDevice(CAPACITY)
        return
    tier = GpuTier(GpuConfig(enabled=True, capacity_bytes=CAPACITY))
    yield tier
    tier.close()


def payload(digest: bytes, size: int = UNIT) -> np.ndarray:
    """The bytes of object `digest` (kvs_testing.payload), read-only like arena views."""
    data = kvs_testing.payload(size, ObjectId(digest))
    data.flags.writeable = False
    return data


def read(device, extent: Extent, size: int) -> bytes:
    view = device.view(extent)[:size]
    return view.tobytes() if isinstance(view, np.ndarray) else view.cpu().numpy().tobytes()


def put(copies: GpuCopies, name: str, size: int = UNIT, namespace: str = "t") -> Extent | None:
    digest = name.encode().ljust(32, b"\0")
    return copies.copy_in(namespace, digest, payload(digest, size), size)


def d(name: str) -> bytes:
    return name.encode().ljust(32, b"\0")


def held(copies: GpuCopies, names: str) -> list[bool]:
    return [copies.holds("t", d(n)) for n in names]


def assert_bytes_intact(device, copies: GpuCopies, names: str) -> None:
    """Each named copy still holds its object's bytes (read under a reader, as an engine would)."""
    for name in names:
        extent = copies.acquire("t", d(name))
        assert read(device, extent, UNIT) == payload(d(name)).tobytes(), name
        copies.release("t", d(name))
    copies.check_integrity()


def test_a_copy_reads_back_bit_exact_and_copy_in_is_idempotent(device):
    copies = GpuCopies(device)
    extent = put(copies, "a", 1000)
    assert read(device, extent, 1000) == payload(d("a"), 1000).tobytes()
    assert copies.holds("t", d("a")) and not copies.holds("other", d("a"))
    assert put(copies, "a", 1000) == extent  # held already: no second copy
    assert copies.stats()["num_copies_in"] == 1 and copies.stats()["objects"] == 1
    copies.check_integrity()


def test_memoryview_and_typed_arrays_copy_as_their_bytes(device):
    copies = GpuCopies(device)
    floats = np.arange(64, dtype=np.float32)
    extent = copies.copy_in("t", d("f"), memoryview(floats.tobytes()), floats.nbytes)
    assert read(device, extent, floats.nbytes) == floats.tobytes()
    extent = copies.copy_in("t", d("g"), floats, floats.nbytes)
    assert read(device, extent, floats.nbytes) == floats.tobytes()


def test_least_recently_used_unread_copy_is_evicted_first(device):
    copies = GpuCopies(device)
    for name in "abcd":
        put(copies, name)
    copies.acquire("t", d("a"))  # a is used again: b is now the oldest
    copies.release("t", d("a"))
    put(copies, "e")
    assert held(copies, "abcde") == [True, False, True, True, True]
    put(copies, "c")  # copy_in of a held copy touches it too: d is now the oldest
    put(copies, "f")
    assert held(copies, "acdef") == [True, True, False, True, True]
    assert copies.stats()["num_gpu_evictions"] == 2
    assert_bytes_intact(device, copies, "acef")


def test_a_copy_with_a_reader_is_never_evicted(device):
    copies = GpuCopies(device)
    for name in "abcd":
        put(copies, name)
        copies.acquire("t", d(name))
    assert put(copies, "e") is None  # every copy has a reader
    assert copies.stats()["num_gpu_evictions"] == 0 and all(held(copies, "abcd"))
    copies.release("t", d("c"))
    assert put(copies, "e") is not None
    assert held(copies, "abcde") == [True, True, False, True, True]
    assert_bytes_intact(device, copies, "abde")


def test_nothing_is_evicted_in_vain_when_readers_fragment_the_tier(device):
    copies = GpuCopies(device)
    for name in "abcd":
        put(copies, name)
    copies.acquire("t", d("b"))
    copies.acquire("t", d("d"))  # free a and c and no gap is two units wide
    assert put(copies, "big", 2 * UNIT) is None
    assert copies.holds("t", d("a")) and copies.holds("t", d("c"))
    assert copies.stats()["num_gpu_evictions"] == 0
    copies.release("t", d("b"))  # now a, b, c are a three-unit gap
    assert put(copies, "big", 2 * UNIT) is not None
    copies.check_integrity()


def test_an_object_larger_than_the_tier_is_refused_without_evicting(device):
    copies = GpuCopies(device)
    put(copies, "a")
    assert put(copies, "huge", CAPACITY + 1) is None
    assert copies.holds("t", d("a")) and copies.stats()["num_gpu_evictions"] == 0
    assert put(copies, "whole", CAPACITY) is not None  # the whole tier: a goes
    assert not copies.holds("t", d("a"))


def test_forget_while_read_frees_the_copy_when_its_last_reader_leaves(device):
    copies = GpuCopies(device)
    extent = put(copies, "a")
    copies.acquire("t", d("a"))
    copies.acquire("t", d("a"))
    assert copies.forget("t", d("a")) is True
    assert not copies.holds("t", d("a")) and copies.acquire("t", d("a")) is None
    assert put(copies, "a") is None  # the old copy is still being read: the host serves it
    assert device.allocator.is_allocated(extent) and read(device, extent, UNIT) == payload(d("a")).tobytes()
    assert copies.forget("t", d("a")) is False  # idempotent
    copies.release("t", d("a"))
    assert device.allocator.is_allocated(extent)
    copies.release("t", d("a"))
    assert device.allocator.used_bytes == 0 and copies.stats()["objects"] == 0
    with pytest.raises(InvalidArgument, match="without a reader"):
        copies.release("t", d("a"))
    assert put(copies, "a") is not None  # a new copy of the new object
    copies.check_integrity()


def test_forget_namespace_drops_only_that_namespace(device):
    copies = GpuCopies(device)
    put(copies, "a", namespace="one")
    put(copies, "a", namespace="two")  # same id, another tenant: its own copy
    put(copies, "b", namespace="one")
    copies.acquire("one", d("b"))
    assert copies.forget_namespace("one") == 2
    assert copies.holds("two", d("a")) and not copies.holds("one", d("a")) and not copies.holds("one", d("b"))
    assert copies.stats()["objects"] == 1 and copies.stats()["readers"] == 1
    copies.release("one", d("b"))
    assert copies.stats()["readers"] == 0 and device.allocator.num_allocated == 1
    copies.check_integrity()


def test_stats_count_copies_hits_and_evictions(device):
    copies = GpuCopies(device)
    for name in "abcde":
        put(copies, name)
    copies.acquire("t", d("e"))
    assert copies.acquire("t", d("a")) is None  # evicted: a miss is not a hit
    assert copies.stats() == {"objects": 4, "copying": 0, "readers": 1, "used_bytes": CAPACITY, "capacity_bytes": CAPACITY,
                              "num_copies_in": 5, "num_gpu_hits": 1, "num_gpu_evictions": 1}


def test_a_copy_made_in_two_phases_is_invisible_and_kept_until_finished(device):
    copies = GpuCopies(device)
    for name in "abc":
        put(copies, name)
    extent = copies.begin_copy("t", d("x"), UNIT)  # the fourth unit: nothing evicted yet
    assert extent is not None and copies.stats()["copying"] == 1
    assert not copies.holds("t", d("x")) and copies.acquire("t", d("x")) is None
    assert put(copies, "x") is None and copies.begin_copy("t", d("x"), UNIT) is None  # in flight
    for name in "def":
        put(copies, name)  # evicts a, b, c: never the copy being written
    assert not any(held(copies, "abc")) and device.allocator.is_allocated(extent)
    device.copy_from_host(extent, payload(d("x")))  # as a worker thread would
    assert copies.finish_copy("t", d("x"), copied=True) is True
    assert copies.holds("t", d("x")) and copies.stats()["num_copies_in"] == 7
    assert_bytes_intact(device, copies, "x")
    with pytest.raises(InvalidArgument, match="without begin_copy"):
        copies.finish_copy("t", d("x"), copied=True)


def test_a_two_phase_copy_that_failed_or_was_forgotten_gives_its_room_back(device):
    copies = GpuCopies(device)
    copies.begin_copy("t", d("a"), UNIT)
    assert copies.finish_copy("t", d("a"), copied=False) is False
    assert device.allocator.used_bytes == 0 and not copies.holds("t", d("a"))
    copies.begin_copy("t", d("b"), CAPACITY)
    assert put(copies, "c") is None  # the whole tier is being written
    assert copies.forget("t", d("b")) is True and device.allocator.used_bytes == CAPACITY
    assert copies.finish_copy("t", d("b"), copied=True) is False  # its object went meanwhile
    assert device.allocator.used_bytes == 0 and copies.stats()["num_copies_in"] == 0
    copies.check_integrity()


def test_bad_host_buffers_are_refused_before_anything_changes():
    copies = GpuCopies(NumpyDevice(CAPACITY))
    with pytest.raises(InvalidArgument, match="positive int"):
        copies.copy_in("t", d("a"), bytes(10), 0)
    with pytest.raises(InvalidArgument, match="the host buffer holds 10"):
        copies.copy_in("t", d("a"), bytes(10), 11)
    assert copies.stats()["objects"] == 0


def test_a_failed_device_copy_frees_its_extent():
    device = NumpyDevice(CAPACITY)
    copies = GpuCopies(device)
    device.fail_next_copy = True
    with pytest.raises(RuntimeError, match="copy failed"):
        put(copies, "a")
    assert not copies.holds("t", d("a")) and device.allocator.used_bytes == 0
    copies.check_integrity()


def test_integrity_check_catches_an_extent_the_index_does_not_know():
    device = NumpyDevice(CAPACITY)
    copies = GpuCopies(device)
    put(copies, "a")
    device.alloc(UNIT)  # someone else allocated on the tier
    with pytest.raises(RuntimeError, match="2 extents allocated but 1 copies indexed"):
        copies.check_integrity()


def test_random_operations_keep_index_readers_and_bytes_consistent(device):
    rng = random.Random(14)
    copies = GpuCopies(device)
    names = [f"o{i}" for i in range(12)]
    size_of = {n: (100, UNIT, 2 * UNIT, 3 * UNIT)[i % 4] for i, n in enumerate(names)}  # one id, one object
    readers: dict[tuple[str, str], list] = {}  # what the test holds: [count, extent]
    forgotten: set[tuple[str, str]] = set()  # read copies whose object was forgotten
    writing: list[tuple[str, str, Extent]] = []  # begun, not finished
    for step in range(600):
        op, ns, name = rng.randrange(8), rng.choice(["x", "y"]), rng.choice(names)
        key = (ns, name)
        held = readers.get(key, [0, None])
        if op <= 1:
            extent = put(copies, name, size_of[name], ns)
            assert (extent is None) if key in forgotten else (extent is None or copies.holds(ns, d(name)))
        elif op == 2:
            extent = copies.acquire(ns, d(name))
            assert extent is None or (key not in forgotten and held[1] in (None, extent))
            if extent is not None:
                readers[key] = [held[0] + 1, extent]
        elif op == 3 and held[0]:
            copies.release(ns, d(name))
            held[0] -= 1
            if held[0] == 0:
                del readers[key]
                forgotten.discard(key)
        elif op == 4:
            if copies.forget(ns, d(name)) and held[0]:
                forgotten.add(key)
        elif op == 5 and rng.random() < 0.2:
            forgotten.update(k for k in readers if k[0] == ns)
            copies.forget_namespace(ns)
        elif op == 6 and len(writing) < 2:  # a copy made off the loop: begun now, finished later
            extent = copies.begin_copy(ns, d(name), size_of[name])
            if extent is not None:
                writing.append((ns, name, extent))
        elif op == 7 and writing:
            ns_, name_, extent = writing.pop(rng.randrange(len(writing)))
            device.copy_from_host(extent, payload(d(name_), size_of[name_]))
            assert copies.finish_copy(ns_, d(name_), copied=True) == copies.holds(ns_, d(name_))
        copies.check_integrity()
        assert copies.stats()["readers"] == sum(count for count, _ in readers.values()), step
        assert copies.stats()["copying"] == len(writing), step
        for (ns_, name_), (_, extent) in readers.items():  # a read copy stays, with its bytes
            assert copies.holds(ns_, d(name_)) == ((ns_, name_) not in forgotten)
            assert read(device, extent, size_of[name_]) == payload(d(name_), size_of[name_]).tobytes(), step
    stats = copies.stats()
    assert stats["num_gpu_evictions"] > 0 and stats["num_gpu_hits"] > 0 and forgotten is not None
    for (ns, name), (count, _) in readers.items():
        for _ in range(count):
            copies.release(ns, d(name))
    for ns, name, _ in writing:
        copies.finish_copy(ns, d(name), copied=False)
    assert copies.stats()["readers"] == 0 and copies.stats()["objects"] == device.allocator.num_allocated
    copies.check_integrity()
