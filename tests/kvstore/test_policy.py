"""One conformance suite run against every eviction policy, then each policy's own behaviour."""

from __future__ import annotations

import ast
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstore.policy
from kvstore.errors import InvalidArgument
from kvstore.policy import LRU, POLICIES, S3FIFO, CostAwareS3FIFO, EvictionPolicy, make_policy


def always(key) -> bool:
    return True


def never(key) -> bool:
    return False


def admit(policy: EvictionPolicy, key, size_bytes: int, **hints) -> list:
    """Act as a tier: make room under the capacity, then insert. Returns the evicted keys."""
    overflow = policy.tracked_bytes + size_bytes - policy.capacity_bytes
    evicted = policy.victims(overflow, always)
    policy.on_insert(key, size_bytes, **hints)
    return evicted


@pytest.fixture(params=sorted(POLICIES))
def policy(request) -> EvictionPolicy:
    return POLICIES[request.param](10_000)


def fill(policy: EvictionPolicy, num_keys: int = 20) -> dict:
    """Insert keys 0..n-1 with assorted sizes, access some; returns key -> size."""
    sizes = {key: 10 + 7 * (key % 5) for key in range(num_keys)}
    for key, size in sizes.items():
        policy.on_insert(key, size)
    for key in range(0, num_keys, 3):
        policy.on_access(key)
    return sizes


# --- registry --------------------------------------------------------------------------


def test_registry_names_match_classes():
    assert POLICIES == {"s3fifo": S3FIFO, "cost_aware": CostAwareS3FIFO, "lru": LRU}
    for name, cls in POLICIES.items():
        made = make_policy(name, 4096)
        assert type(made) is cls and made.name == name and made.capacity_bytes == 4096


def test_make_policy_unknown_name_lists_known_policies():
    with pytest.raises(InvalidArgument) as info:
        make_policy("arc", 4096)
    for name in POLICIES:
        assert name in str(info.value)


@pytest.mark.parametrize("capacity", [0, -1, 1.5, True, "10"])
def test_bad_capacity_rejected(capacity):
    for cls in POLICIES.values():
        with pytest.raises(InvalidArgument):
            cls(capacity)


# --- conformance: every policy -------------------------------------------------------


def test_double_insert_raises(policy):
    policy.on_insert("a", 10)
    with pytest.raises(InvalidArgument):
        policy.on_insert("a", 20)
    assert len(policy) == 1 and policy.tracked_bytes == 10
    policy.check_integrity()


@pytest.mark.parametrize(
    "fields",
    [{"size_bytes": 0}, {"size_bytes": -5}, {"size_bytes": 2.0}, {"recompute_cost": -1.0},
     {"recompute_cost": float("nan")}, {"priority": 11}, {"priority": -11}, {"priority": 1.0}],
)
def test_bad_insert_fields_rejected_and_nothing_tracked(policy, fields):
    args = {"size_bytes": 10, **fields}
    with pytest.raises(InvalidArgument):
        policy.on_insert("a", **args)
    assert "a" not in policy and len(policy) == 0 and policy.tracked_bytes == 0
    policy.check_integrity()


def test_unknown_keys_are_harmless(policy):
    sizes = fill(policy)
    before = (len(policy), policy.tracked_bytes)
    policy.on_remove("missing")
    policy.on_access("missing")
    policy.on_remove(3)
    policy.on_remove(3)  # idempotent
    assert (len(policy), policy.tracked_bytes) == (before[0] - 1, before[1] - sizes[3])
    policy.check_integrity()


def test_nonpositive_need_returns_nothing(policy):
    fill(policy)
    assert policy.victims(0, always) == []
    assert policy.victims(-100, always) == []
    assert len(policy) == 20


def test_victims_cover_need_and_are_untracked(policy):
    sizes = fill(policy)
    before = policy.tracked_bytes
    chosen = policy.victims(100, always)
    assert len(set(chosen)) == len(chosen)
    assert sum(sizes[key] for key in chosen) >= 100
    assert not any(key in policy for key in chosen)
    assert policy.tracked_bytes == before - sum(sizes[key] for key in chosen)
    assert len(policy) == 20 - len(chosen)
    policy.check_integrity()


def test_victims_never_include_unevictable(policy):
    sizes = fill(policy)
    chosen = policy.victims(10**9, lambda key: key % 2 == 1)
    assert sorted(chosen) == [key for key in sizes if key % 2 == 1]  # not enough: all evictable
    assert all(key in policy for key in sizes if key % 2 == 0)
    assert policy.tracked_bytes == sum(size for key, size in sizes.items() if key % 2 == 0)
    policy.check_integrity()


def test_pinned_keys_survive_then_evictable_once_unpinned(policy):
    sizes = fill(policy)
    pinned = {0, 5, 19}
    assert set(policy.victims(10**9, lambda key: key not in pinned)) == set(sizes) - pinned
    assert all(key in policy for key in pinned)
    assert sorted(policy.victims(1, always)) in ([0], [5], [19])
    assert len(policy.victims(10**9, always)) == 2 and len(policy) == 0 and policy.tracked_bytes == 0
    policy.check_integrity()


def test_nothing_evictable_leaves_state_intact(policy):
    """A call that steps over every key must not change what later calls choose."""
    twin = type(policy)(policy.capacity_bytes)
    for p in (policy, twin):
        fill(p, 40)
        p.victims(150, always)
    assert policy.victims(10**9, never) == []
    assert policy.tracked_bytes == twin.tracked_bytes
    assert policy.victims(10**9, always) == twin.victims(10**9, always)


def test_scan_of_pinned_keys_is_bounded(policy):
    fill(policy, 200)
    calls = []
    assert policy.victims(10**9, lambda key: calls.append(key) or False) == []
    assert len(calls) <= 200 * 5
    assert set(calls) <= set(range(200))


def test_evicted_key_can_be_inserted_again(policy):
    fill(policy)
    chosen = policy.victims(1, always)
    policy.on_insert(chosen[0], 99)
    assert chosen[0] in policy
    policy.check_integrity()


def test_check_integrity_catches_drifted_bytes(policy):
    fill(policy)
    policy.check_integrity()
    policy._tracked_bytes += 1
    with pytest.raises(RuntimeError, match="tracked_bytes"):
        policy.check_integrity()


_KEYS = st.integers(0, 15)
_OPS = st.one_of(
    st.tuples(st.just("insert"), _KEYS, st.integers(1, 300), st.none() | st.floats(0, 1e4), st.integers(-10, 10)),
    st.tuples(st.just("access"), _KEYS),
    st.tuples(st.just("remove"), _KEYS),
    st.tuples(st.just("victims"), st.integers(-10, 1500), st.frozensets(_KEYS)),
)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 2000), ops=st.lists(_OPS, max_size=60))
def test_random_operations_keep_accounting(name, capacity, ops):
    policy = make_policy(name, capacity)
    model: dict = {}
    for op in ops:
        if op[0] == "insert":
            _, key, size, cost, priority = op
            if key in model:
                with pytest.raises(InvalidArgument):
                    policy.on_insert(key, size, cost, priority)
            else:
                policy.on_insert(key, size, cost, priority)
                model[key] = size
        elif op[0] == "access":
            policy.on_access(op[1])
        elif op[0] == "remove":
            policy.on_remove(op[1])
            model.pop(op[1], None)
        else:
            _, needed, pinned = op
            asked = []

            def evictable(key):
                asked.append(key)
                return key not in pinned

            chosen = policy.victims(needed, evictable)
            assert set(asked) <= set(model), "predicate asked about an untracked key"
            assert len(set(chosen)) == len(chosen) and set(chosen) <= set(model) - pinned
            freed = sum(model[key] for key in chosen)
            evictable_keys = set(model) - pinned
            if needed <= 0:
                assert chosen == []
            elif sum(model[key] for key in evictable_keys) >= needed:
                assert freed >= needed
            else:
                assert set(chosen) == evictable_keys
            for key in chosen:
                del model[key]
        policy.check_integrity()
        assert policy.tracked_bytes == sum(model.values()) and len(policy) == len(model)
        assert all(key in policy for key in model)


# --- S3-FIFO and cost-aware S3-FIFO ----------------------------------------------------

FIFO_POLICIES = [S3FIFO, CostAwareS3FIFO]


@pytest.mark.parametrize("cls", FIFO_POLICIES)
def test_one_hit_wonder_scan_keeps_reused_objects(cls):
    def run(policy):
        for key in range(40):
            admit(policy, f"warm{key}", 10)
            policy.on_access(f"warm{key}")
        for key in range(5000):
            admit(policy, f"scan{key}", 10)
        return sum(f"warm{key}" in policy for key in range(40))

    assert run(cls(1000)) == 40
    assert run(LRU(1000)) == 0  # the same trace flushes a recency list


@pytest.mark.parametrize("cls", FIFO_POLICIES)
def test_ghost_hit_goes_to_main(cls):
    policy = cls(1000)
    share = policy.small_target_bytes  # S's share of the 1000 bytes
    admit(policy, "a", 10)
    assert policy.victims(1, always) == ["a"]  # a one-hit wonder, remembered in the ghost
    admit(policy, "a", 10)
    for key in range(2 * share // 10):
        admit(policy, f"new{key}", 10)
    # S holds twice its share: these 100 bytes come from S, and `a` is not there.
    assert "a" not in policy.victims(100, always)
    assert "a" in policy
    assert "a" in policy._main


@pytest.mark.parametrize("cls", FIFO_POLICIES)
def test_ghost_stays_bounded(cls):
    policy = cls(1000)
    for key in range(3000):
        admit(policy, key, 1)
    assert policy._ghost.bytes <= 900 and len(policy._ghost) <= 900
    policy.check_integrity()


def test_s3fifo_is_fifo_among_exhausted_objects():
    policy = S3FIFO(10**6)
    policy.on_insert("costly", 10, recompute_cost=1000.0)
    policy.on_insert("cheap", 1000, recompute_cost=10.0)
    assert policy.victims(1, always) == ["costly"]


def test_cost_aware_evicts_cheap_large_object_first():
    policy = CostAwareS3FIFO(10**6)
    policy.on_insert("costly", 10, recompute_cost=1000.0)  # oldest: plain FIFO would take it
    policy.on_insert("cheap", 1000, recompute_cost=10.0)
    assert policy.victims(1, always) == ["cheap"]
    policy.check_integrity()


def test_cost_aware_scores_per_byte():
    policy = CostAwareS3FIFO(10**6)
    policy.on_insert("small", 10, recompute_cost=500.0)
    policy.on_insert("large", 1000, recompute_cost=500.0)  # same cost, freed 100x the bytes
    assert policy.victims(1, always) == ["large"]


def test_cost_aware_without_hints_is_fifo():
    policy = CostAwareS3FIFO(10**6)
    for key, size in zip("abcd", (500, 10, 2000, 70)):
        policy.on_insert(key, size)
    assert policy.victims(10**9, always) == list("abcd")


def test_cost_aware_respects_priority():
    policy = CostAwareS3FIFO(10**6)
    policy.on_insert("high", 100, priority=10)
    policy.on_insert("normal", 100)
    policy.on_insert("low", 100, priority=-10)
    assert policy.victims(250, always) == ["low", "normal", "high"]


def test_cost_aware_window_is_four_and_keeps_the_others_in_order():
    policy = CostAwareS3FIFO(10**6)
    for key, priority in zip("abcde", (0, 0, -5, 0, -10)):
        policy.on_insert(key, 100, priority=priority)
    # `e` is the cheapest, but beyond the window of four at the tail.
    assert policy.victims(1, always) == ["c"]
    assert policy.victims(10**9, always) == ["e", "a", "b", "d"]


def test_cost_aware_skips_pinned_candidates():
    policy = CostAwareS3FIFO(10**6)
    policy.on_insert("pinned_cheap", 1000, recompute_cost=1.0)
    policy.on_insert("costly", 10, recompute_cost=1000.0)
    assert policy.victims(1, lambda key: key != "pinned_cheap") == ["costly"]
    assert "pinned_cheap" in policy
    policy.check_integrity()


# --- LRU ------------------------------------------------------------------------------


def test_lru_evicts_least_recently_used_first():
    policy = LRU(10**6)
    for key in "abcd":
        policy.on_insert(key, 10)
    policy.on_access("a")
    policy.on_access("c")
    assert policy.victims(10**9, always) == list("bdac")


# --- purity ---------------------------------------------------------------------------

_ALLOWED_IMPORTS = {"__future__", "abc", "collections", "dataclasses", "math", "typing"}


def test_policy_package_imports_only_stdlib_and_itself():
    """Policies decide, tiers act: an import of tiers/server/client/gpu or asyncio fails here."""
    package_dir = pathlib.Path(kvstore.policy.__file__).parent
    for path in package_dir.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                ok = top in _ALLOWED_IMPORTS or name == "kvstore.errors" or name.startswith("kvstore.policy")
                assert ok, f"{path.name} imports {name}"


# --- compaction (issue 15: memory given back after eviction) ----------------------------


def test_compact_rebuilds_a_sparse_policy_and_keeps_its_order(policy):
    from kvstore.policy.base import COMPACT_MIN_KEYS
    big = type(policy)(1 << 40)
    n = 4 * COMPACT_MIN_KEYS
    for key in range(n):
        big.on_insert(key, 10)
    for key in range(0, n, 3):
        big.on_access(key)
    assert not big.compact()  # full: nothing to give back
    keep = list(range(n - COMPACT_MIN_KEYS // 2, n))
    for key in range(n - COMPACT_MIN_KEYS // 2):
        big.on_remove(key)
    twin = type(policy)(1 << 40)  # the same history, never compacted
    for key in range(n):
        twin.on_insert(key, 10)
    for key in range(0, n, 3):
        twin.on_access(key)
    for key in range(n - COMPACT_MIN_KEYS // 2):
        twin.on_remove(key)
    assert big.compact() and not big.compact()  # rebuilt once, then no longer sparse
    big.check_integrity()
    assert sorted(k for k in keep if k in big) == keep
    # Same victims in the same order as the uncompacted twin: compaction changes no decision.
    assert big.victims(10 * 100, always) == twin.victims(10 * 100, always)


def test_small_policies_are_never_rebuilt(policy):
    fill(policy, 50)
    for key in range(49):
        policy.on_remove(key)
    assert not policy.compact()
