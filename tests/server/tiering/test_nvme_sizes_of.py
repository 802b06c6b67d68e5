"""Many keys probed at once (NvmeTable.sizes_of, TierMover.sizes_of: a lookup, delete or
prefetch of many ids) answer exactly what a key at a time answers."""

import random

import numpy as np

from kvstore.config import HostTierConfig, NvmeTierConfig
from kvstore.identity import ObjectId
from kvstore.server.tiering.chain import compose
from kvstore.server.tiering.manager import TierManager
from kvstore.server.tiering.nvme_held import NvmeHeld
from kvstore.server.tiering.nvme_mover import TierMover
from kvstore.server.tiering.nvme_table import NvmeTable
from kvstore.tiers.nvme.index import namespace_prefix, object_key


def test_sizes_of_many_ids_match_one_at_a_time_past_tombstones_and_other_namespaces():
    rng = random.Random(11)
    table = NvmeTable(1 << 40, rows=64)
    ids = [ObjectId(rng.randbytes(32)) for _ in range(3000)]
    for i, oid in enumerate(ids[:2000]):
        table.on_insert(object_key("a" if i % 3 else "b", oid), 100 + i)
    for oid in ids[:2000:5]:  # tombstones on the probe paths
        table.on_remove(object_key("a", oid))
        table.on_remove(object_key("b", oid))
    probe = ids[::2] + [ObjectId(bytes(32))]
    got = table.sizes_of(namespace_prefix("a"), np.frombuffer(b"".join(probe), np.uint8).reshape(-1, 32))
    assert got.tolist() == [table.size_of(object_key("a", oid)) or 0 for oid in probe]
    assert 0 < int(np.count_nonzero(got)) < len(probe)
    none = table.sizes_of(namespace_prefix("never"), np.zeros((4, 32), np.uint8))
    assert none.tolist() == [0, 0, 0, 0]


def test_the_mover_answers_sizes_of_few_and_many_ids_alike(tmp_path):
    config = NvmeTierConfig(path=str(tmp_path))
    manager = TierManager(compose(HostTierConfig(arena_bytes=1 << 20, prefault=False),
                                  make_holdings=lambda: NvmeHeld(config.capacity_bytes),
                                  make_nvme=lambda host, events, sends, departures, held: TierMover(
                                      host, events, sends, departures, held, config)))
    mover = manager.nvme
    ids = [ObjectId(bytes([i]) * 32) for i in range(1, 60)]
    for oid in ids[::2]:
        mover._remember(mover.held.key("t", oid), 4096)
    for batch in (ids[:5], ids):
        assert mover.sizes_of("t", batch) == [4096 if i % 2 == 0 else None for i in range(len(batch))]
    assert mover.sizes_of("other", ids) == [None] * len(ids)
    found = manager.index.lookup("t", ids)  # one leading hit, then a miss
    assert list(found.names()) == ["nvme" if i % 2 == 0 else None for i in range(len(ids))] and found.hits == 1
