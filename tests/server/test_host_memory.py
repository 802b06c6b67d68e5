"""The memory checks of the host tier, against stated amounts of memory (the daemon tests
start real daemons for the same checks against this machine's)."""

import pytest

from kvstore.config import HostTierConfig
from kvstore.errors import CapacityError, InvalidArgument
from kvstore.server.host_memory import HostMemory, check_host_tier, check_new_arena, host_memory

GiB = 1 << 30
MACHINE = HostMemory(total_bytes=16 * GiB, available_bytes=12 * GiB)  # headroom: 1.6 GiB


def test_this_machine_has_memory():
    memory = host_memory()
    assert 0 < memory.available_bytes <= memory.total_bytes


def test_one_arena_larger_than_the_machine_is_refused_even_without_prefault():
    with pytest.raises(InvalidArgument, match=r"host\.arena_bytes = 17\.00 GiB .*\(16\.00 GiB\)"):
        check_host_tier(HostTierConfig(arena_bytes=17 * GiB, prefault=False), MACHINE)


def test_prefaulted_namespaces_must_fit_what_is_available_less_headroom():
    check_host_tier(HostTierConfig(arena_bytes=5 * GiB, namespaces=("a", "b")), MACHINE)  # 10 of 10.4
    with pytest.raises(InvalidArgument, match=r"host\.namespaces.*12\.00 GiB of memory is available"):
        check_host_tier(HostTierConfig(arena_bytes=4 * GiB, namespaces=("a", "b", "c")), MACHINE)
    check_host_tier(HostTierConfig(arena_bytes=4 * GiB, namespaces=("a", "b", "c"), prefault=False), MACHINE)


def test_a_later_namespace_that_does_not_fit_is_a_capacity_error():
    check_new_arena(HostTierConfig(arena_bytes=10 * GiB), MACHINE, "t")
    with pytest.raises(CapacityError, match="namespace 't'"):
        check_new_arena(HostTierConfig(arena_bytes=11 * GiB), MACHINE, "t")
    check_new_arena(HostTierConfig(arena_bytes=11 * GiB, prefault=False), MACHINE, "t")  # taken as written
