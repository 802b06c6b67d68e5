"""The daemon's index of NVMe objects (server/tiering/nvme_table.py): S3-FIFO over numpy
columns must choose exactly the victims the reference S3-FIFO (kvstore/policy/s3fifo.py)
chooses, find every key it holds and no other, and refuse bad input unchanged."""

import random

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.identity import ObjectId
from kvstore.policy import S3FIFO
from kvstore.server.tiering.nvme_table import NvmeTable
from kvstore.tiers.nvme.holdings import split_keys
from kvstore.tiers.nvme.index import object_key


def key(i: int, namespace: str = "t") -> bytes:
    return object_key(namespace, ObjectId(random.Random(i).randbytes(32)))


def run_both(seed: int, steps: int, capacity: int = 10**6):
    """Random inserts, hits, removes and victims() against both; they must agree at every step."""
    rng = random.Random(seed)
    table, reference = NvmeTable(capacity, rows=16), S3FIFO(capacity)
    pinned = {key(j, "ab"[j % 2]) for j in range(0, 3000, 7)}
    for step in range(steps):
        op, i = rng.random(), rng.randrange(3000)
        k = key(i, "ab"[i % 2])
        if op < 0.4 and k not in reference:
            size, priority = rng.choice([1000, 4096, 50_000]), rng.randint(-10, 10)
            reference.on_insert(k, size, priority=priority)
            table.on_insert(k, size, priority=priority)
        elif op < 0.7:
            reference.on_access(k)
            table.on_access(k)
        elif op < 0.85:
            reference.on_remove(k)
            table.on_remove(k)
        elif op < 0.999:
            need = rng.randrange(1, 200_000)
            assert table.victims(need, lambda x: x not in pinned) == reference.victims(need, lambda x: x not in pinned)
        else:
            table.compact()
        assert (len(table), table.tracked_bytes) == (len(reference), reference.tracked_bytes)
        assert (k in table) == (k in reference) and table.size_of(k) == reference.size_of(k)
        if step % 1000 == 0:
            table.check_integrity()
    table.check_integrity()
    assert sorted(table.keys()) == sorted(reference.keys())
    return table, reference


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_table_chooses_the_reference_s3fifo_s_victims(seed):
    run_both(seed, 6000)


def test_removed_rows_are_reused_once_their_places_are_passed_and_compact_gives_room_back():
    table, reference = NvmeTable(1 << 40), S3FIFO(1 << 40)
    for round_ in range(6):
        keys = [key(round_ * 10_000 + i) for i in range(5000)]
        for k in keys:
            table.on_insert(k, 4096)
            reference.on_insert(k, 4096)
        for k in keys[:4900]:
            table.on_remove(k)
            reference.on_remove(k)
    table.check_integrity()
    assert table._next < 3 * 5000  # stale places were dropped and their rows taken again
    assert table.compact() and table._next == len(table) == 600 and len(table.state) <= 1200
    table.check_integrity()
    assert table.victims(1 << 40, lambda k: True) == reference.victims(1 << 40, lambda k: True)


def test_ids_crafted_to_share_most_bytes_stay_apart_and_do_not_share_a_probe_chain():
    table = NvmeTable(1 << 30, rows=1 << 12)
    twins = [object_key("t", ObjectId(bytes(31) + bytes([i]))) for i in range(1, 40)]
    homes = {table._home(table._hash(0, k[-32:])) for k in twins}
    assert len(homes) > 30  # keyed hash of all 32 bytes: not one chain of 39
    twins += [object_key("t", ObjectId(bytes(8) + bytes([i]) * 24)) for i in range(1, 40)]
    for i, k in enumerate(twins):
        table.on_insert(k, 100 + i)
    assert [table.size_of(k) for k in twins] == [100 + i for i in range(78)]
    assert object_key("t", ObjectId(bytes(8) + bytes([99]) * 24)) not in table
    table.on_remove(twins[5])
    assert twins[5] not in table and table.size_of(twins[6]) == 106
    table.check_integrity()


def test_load_learns_in_age_order_what_inserts_one_by_one_would():
    keys = [key(i, ("x", "yy", "x")[i % 3]) for i in range(5000)]
    sizes = np.array([4096 + 64 * (i % 5) for i in range(5000)], np.int64)
    order = np.random.default_rng(7).permutation(5000)
    prefixes: dict[bytes, int] = {}
    numbers, ids = split_keys(keys, prefixes)
    table, reference = NvmeTable(5000 * 4096), S3FIFO(5000 * 4096)
    table.load(list(prefixes), [numbers[:1000], numbers[1000:]], [ids[:1000], ids[1000:]], sizes, order)
    for i in order.tolist():
        reference.on_insert(keys[i], int(sizes[i]))
    table.check_integrity()
    assert len(table) == 5000 and table.tracked_bytes == int(sizes.sum())
    assert all(table.size_of(k) == int(s) for k, s in zip(keys, sizes))
    for k in keys[::3]:
        table.on_access(k)
        reference.on_access(k)
    assert table.victims(10**6, lambda k: True) == reference.victims(10**6, lambda k: True)


def test_bad_input_is_refused_by_name_and_changes_nothing():
    table = NvmeTable(1 << 30)
    table.on_insert(key(1), 10)
    for bad in ("a string", b"short", 7):
        with pytest.raises(InvalidArgument, match="NVMe index key"):
            table.on_insert(bad, 10)
    for size in (0, -1, 2.5, True):
        with pytest.raises(InvalidArgument, match="size_bytes"):
            table.on_insert(key(2), size)
    with pytest.raises(InvalidArgument, match="recompute cost"):
        table.on_insert(key(2), 10, recompute_cost=1.0)
    with pytest.raises(InvalidArgument, match="already tracked"):
        table.on_insert(key(1), 10)
    with pytest.raises(InvalidArgument, match="empty NVMe table"):
        table.load([], [], [], np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert len(table) == 1 and key(2) not in table
    table.check_integrity()
    twice = [key(3), key(4), key(3)]
    prefixes: dict[bytes, int] = {}
    numbers, ids = split_keys(twice, prefixes)
    empty = NvmeTable(1 << 30)
    with pytest.raises(InvalidArgument, match="distinct keys"):
        empty.load(list(prefixes), [numbers], [ids], np.array([1, 2, 3]), np.arange(3))
    assert len(empty) == 0 and key(3) not in empty
    empty.check_integrity()


@pytest.mark.parametrize("damage", ["slot", "stale", "bytes", "twice"])
def test_check_integrity_names_damage(damage):
    table, _ = run_both(4, 1500)
    live = np.nonzero(table.state[:table._next])[0]
    if damage == "slot":  # a row moved past an empty slot: probes cannot find it
        at = np.nonzero(table._slots >= 0)[0][0]
        row = table._slots[at]
        table._slots[at] = -1
        table._slots[(at + len(table._slots) // 2) % len(table._slots)] = row
    elif damage == "stale":
        table.stale[live[0]] += 1
    elif damage == "bytes":
        table._small_bytes += 1
    else:
        table.ids[live[1]] = table.ids[live[0]]
        table.ns[live[1]] = table.ns[live[0]]
        table.hash[live[1]] = table.hash[live[0]]
    with pytest.raises(RuntimeError, match="NVMe table is inconsistent"):
        table.check_integrity()


def test_load_takes_its_order_from_a_future_and_refuses_an_order_that_is_not_a_permutation():
    from concurrent.futures import ThreadPoolExecutor
    keys = [key(i) for i in range(300)]
    prefixes: dict[bytes, int] = {}
    numbers, ids = split_keys(keys, prefixes)
    sizes = np.full(300, 64, np.int64)
    with ThreadPoolExecutor(1) as pool:
        table = NvmeTable(1 << 30)
        table.load(list(prefixes), [numbers], [ids], sizes, pool.submit(lambda: np.arange(299, -1, -1)))
    assert table.victims(64, lambda k: True) == [keys[299]]  # the first in order is the oldest
    for order in (np.zeros(300, np.int64), np.arange(299)):
        empty = NvmeTable(1 << 30)
        with pytest.raises(InvalidArgument, match="order"):
            empty.load(list(prefixes), [numbers], [ids], sizes, order)
        assert len(empty) == 0 and keys[0] not in empty
