"""The NVMe mover's tables shrink after mass evictions and deletes, as the host tier's do."""

from kvstore.config import HostTierConfig, NvmeTierConfig
from server.tiering.manager import TierManager
from server.tiering.nvme_mover import TierMover


def test_the_mover_rebuilds_what_it_holds_once_most_of_it_left(tmp_path):
    manager = TierManager(HostTierConfig(arena_bytes=1 << 20, prefault=False),
                          make_nvme=lambda m: TierMover(m, NvmeTierConfig(path=str(tmp_path))))
    mover = manager.mover
    keys = [("t", i.to_bytes(32, "little")) for i in range(8192)]
    for key in keys:  # what open() and write() record for objects NVMe holds
        mover._remember(key, 4096)
    assert not mover.compact()  # full: nothing to rebuild
    for key in keys[:8000]:  # what evictions and deletes record
        mover._forget(key)
    table = mover.sizes
    assert mover.compact() and mover.sizes is not table  # rebuilt: a quarter of its peak or less
    assert mover.keys() == keys[8000:] and mover.used_bytes == 192 * 4096
    mover.check_integrity()  # the policy was rebuilt in step, the same keys
    assert not mover.compact()  # once is enough
    manager.expire()  # housekeeping runs it, with or without NVMe
