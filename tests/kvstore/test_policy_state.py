"""What eviction policies keep per key since issue 15 (one int of state, S3-FIFO queues of
keys with counted stale places, equal states shared)."""

import pytest

from kvstore.policy import POLICIES, S3FIFO, CostAwareS3FIFO

FIFO_POLICIES = [S3FIFO, CostAwareS3FIFO]


def always(key) -> bool:
    return True


@pytest.fixture(params=sorted(POLICIES))
def policy(request):
    return POLICIES[request.param](10_000)


@pytest.mark.parametrize("cls", FIFO_POLICIES)
def test_a_key_removed_and_inserted_again_takes_its_new_place(cls):
    policy = cls(10**6)
    for key in "abc":
        policy.on_insert(key, 10)
    policy.on_remove("a")  # its old place, ahead of b, stays queued (stale) ...
    policy.on_insert("a", 10)
    policy.check_integrity()
    assert policy.victims(10**9, always) == ["b", "c", "a"]  # ... and is skipped, not taken as a's
    policy.check_integrity()


@pytest.mark.parametrize("cls", FIFO_POLICIES)
def test_stale_places_of_removed_keys_are_dropped_once_they_outnumber_live_keys(cls):
    from kvstore.policy.base import COMPACT_MIN_KEYS
    policy = cls(1 << 40)
    n = 3 * COMPACT_MIN_KEYS
    for key in range(n):
        policy.on_insert(key, 10)
    for key in range(0, n, 2):
        policy.on_access(key)
    policy.victims(10 * (n // 2), always)  # half move to M or go, so both queues hold keys
    for key in range(n):
        policy.on_remove(key)
        assert len(policy._small) + len(policy._main) <= len(policy) + max(COMPACT_MIN_KEYS, len(policy)) + 1
    policy.check_integrity()
    assert len(policy) == 0 and policy.tracked_bytes == 0


@pytest.mark.parametrize("cls", FIFO_POLICIES)
def test_check_integrity_catches_a_place_queued_twice(cls):
    policy = cls(10**6)
    for key in range(20):
        policy.on_insert(key, 10 + key % 5)
    policy.check_integrity()
    policy._small.append(policy._small[0])
    with pytest.raises(RuntimeError, match="places of"):
        policy.check_integrity()


def test_keys_of_one_size_share_one_state_object_and_keep_their_own_state(policy):
    """Equal states are one int (32 B a key saved: base.shared); a hit changes only its key's."""
    size = 123_457  # not a size another test shares: its state int is made here
    for key in range(80):
        policy.on_insert(key, size)
    states = {id(state) for state in policy._entries.values()}
    assert len(states) == 1
    policy.on_access(7)  # S3-FIFO counts it in the key's state; LRU moves the key instead
    assert (policy._entries[7] != policy._entries[8]) == isinstance(policy, tuple(FIFO_POLICIES))
    assert policy._entries[8] is policy._entries[9]
    assert [policy.size_of(key) for key in (7, 8, 79)] == [size] * 3
    policy.check_integrity()


def test_states_past_the_shared_table_s_bound_are_kept_unshared(monkeypatch):
    from kvstore.policy import base
    monkeypatch.setattr(base, "_SHARED_STATES", {})
    monkeypatch.setattr(base, "MAX_SHARED_STATES", 2)
    policy = S3FIFO(10**6)
    for key, size in enumerate((10, 20, 30, 30)):
        policy.on_insert(key, size)
    assert len(base._SHARED_STATES) == 2 and [policy.size_of(key) for key in range(4)] == [10, 20, 30, 30]
    assert policy.victims(10**9, always) == [0, 1, 2, 3]
    policy.check_integrity()
