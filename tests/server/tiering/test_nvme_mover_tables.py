"""The NVMe mover's tables shrink after mass evictions and deletes, as the host tier's do."""

from kvstore.config import HostTierConfig, NvmeTierConfig
from kvstore.server.tiering.chain import compose
from kvstore.server.tiering.manager import TierManager
from kvstore.identity import ObjectId
from kvstore.server.tiering.nvme_held import NvmeHeld
from kvstore.server.tiering.nvme_mover import TierMover
from kvstore.tiers.nvme.index import object_key


def with_nvme(tmp_path) -> TierManager:
    config = NvmeTierConfig(path=str(tmp_path))
    return TierManager(compose(HostTierConfig(arena_bytes=1 << 20, prefault=False),
                               make_holdings=lambda: NvmeHeld(config.capacity_bytes),
                               make_nvme=lambda host, events, sends, departures, held: TierMover(
                                   host, events, sends, departures, held, config)))


def test_the_mover_rebuilds_what_it_holds_once_most_of_it_left(tmp_path):
    manager = with_nvme(tmp_path)
    mover = manager.nvme
    names = [("t", i.to_bytes(32, "little")) for i in range(8192)]
    keys = [mover.held.key(name, digest) for name, digest in names]
    assert keys[0] == object_key("t", ObjectId(names[0][1]))  # the NVMe index's own key
    for key in keys:  # what open() and write() record for objects NVMe holds
        mover._remember(key, 4096)
    assert not mover.compact()  # full: nothing to rebuild
    for key in keys[:8000]:  # what evictions and deletes record
        mover._forget(key)
    assert mover.compact()  # rebuilt: a quarter of its peak or less
    assert mover.keys() == names[8000:] and mover.used_bytes == 192 * 4096
    assert all(mover.size_of(name, digest) == 4096 for name, digest in names[8000:])
    assert mover.size_of(*names[0]) is None and not mover.holds("t", ObjectId(names[0][1]))
    mover.check_integrity()  # the policy was rebuilt in step, the same keys
    assert not mover.compact()  # once is enough
    manager.expire()  # housekeeping runs it, with or without NVMe


def test_num_indexed_counts_host_entries_and_nvme_objects(tmp_path):
    """What decides whether housekeeping's periodic integrity check runs (server/daemon.py:
    INTEGRITY_CHECK_MAX_OBJECTS): it must count every object the check would walk."""
    import asyncio

    from kvstore.hints import Hints
    from kvstore.identity import ObjectId, StateDescriptor
    manager = with_nvme(tmp_path)
    assert manager.num_indexed() == 0
    for i in range(30):
        manager.nvme._remember(manager.nvme.held.key("t", i.to_bytes(32, "little")), 4096)

    async def fill():
        ns = await manager.host.open_namespace("t")
        for i in range(5):
            manager.host.publish(ns, ObjectId(bytes([i]) * 32), ns.arena.alloc(64), 64, bytes(16),
                            StateDescriptor("t", "m", "r"), Hints())
    asyncio.run(fill())
    assert manager.num_indexed() == 35
    without_nvme = TierManager(compose(HostTierConfig(arena_bytes=1 << 20, prefault=False)))
    assert without_nvme.num_indexed() == 0


def test_a_touch_writes_down_under_selective_once_its_hits_pass_write_after_hits(tmp_path):
    """count_shared_hits (op touch) hands NVMe a batch of hits (on_hits): an entry is written
    down once its hits pass write_after_hits within the batch or across batches, as hits
    one at a time (on_hit) would, and never for hits short of it or past it."""
    import asyncio

    from kvstore.hints import Hints
    from kvstore.identity import StateDescriptor
    config = NvmeTierConfig(path=str(tmp_path), write_policy="selective", write_after_hits=3)
    manager = TierManager(compose(HostTierConfig(arena_bytes=1 << 20, prefault=False),
                                  make_holdings=lambda: NvmeHeld(config.capacity_bytes),
                                  make_nvme=lambda host, events, sends, departures, held: TierMover(
                                      host, events, sends, departures, held, config)))
    ids = [ObjectId(bytes([i]) * 32) for i in range(4)]

    async def fill():
        ns = await manager.host.open_namespace("t")
        for oid in ids:
            manager.host.publish(ns, oid, ns.arena.alloc(64), 64, bytes(16), StateDescriptor("t", "m", "r"), Hints())
        return ns
    ns = asyncio.run(fill())
    written, recorded = [], []
    manager.nvme.write_in_background = lambda entry: written.append(entry.object_id)
    record = manager.nvme.admission.record
    manager.nvme.admission.record = lambda key: (recorded.append(key), record(key))
    manager.touch("t", (ids[0], ids[0], ids[1], ids[1], ids[1], ids[2]))
    assert written == [ids[1]]  # its third hit in this batch; ids[0] has two
    manager.touch("t", (ids[0], ids[0], ids[1], ids[3]))
    assert written == [ids[1], ids[0]]  # ids[0]: two, then its third and fourth; ids[1] past it
    assert [ns.objects[oid].num_hits for oid in ids] == [4, 4, 1, 1]
    assert len(recorded) == 10  # every hit counted for admission
    manager.check_integrity()
