"""Rendezvous hashing: stable, balanced, and moving only what must move."""

import hashlib
import subprocess
import sys
from collections import Counter

import pytest

from kvstore.errors import InvalidArgument
from kvstore.identity import ObjectId
from kvstore.ownership import home_nodes, is_home, new_homes, weight

NODES = [f"node-{i}" for i in range(8)]
IDS = [ObjectId(hashlib.blake2b(str(i).encode(), digest_size=32).digest()) for i in range(4000)]


def test_homes_are_distinct_and_bounded():
    for oid in IDS[:200]:
        homes = home_nodes(oid, NODES, 3)
        assert len(homes) == len(set(homes)) == 3
        assert home_nodes(oid, NODES, 1) == homes[:1]  # replica lists nest
    assert len(home_nodes(IDS[0], ["a", "b"], 5)) == 2
    assert home_nodes(IDS[0], [], 1) == []


def test_answer_does_not_depend_on_member_order_or_duplicates():
    oid = IDS[7]
    assert home_nodes(oid, NODES, 2) == home_nodes(oid, list(reversed(NODES)) + NODES, 2)


def test_same_answer_in_another_process():
    """No PYTHONHASHSEED dependence: another interpreter with another seed agrees."""
    code = ("from kvstore.identity import ObjectId; from kvstore.ownership import home_nodes; "
            f"print(home_nodes(ObjectId(bytes.fromhex('{IDS[3].hex}')), {NODES!r}, 3))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PYTHONPATH": "."})
    assert out.stdout.strip() == str(home_nodes(IDS[3], NODES, 3))


def test_weight_is_pinned():
    """The scheme is part of the cluster protocol: nodes of different versions must agree."""
    assert weight("node-a", b"\x00" * 32) == int.from_bytes(
        hashlib.blake2b(b"\x06\x00\x00\x00node-a" + b"\x00" * 32, digest_size=8,
                        person=b"kvstore-home-v1").digest(), "little")


def test_balance():
    counts = Counter(home_nodes(oid, NODES)[0] for oid in IDS)
    expected = len(IDS) / len(NODES)
    assert set(counts) == set(NODES)
    assert max(abs(c - expected) for c in counts.values()) < 0.15 * expected, counts


@pytest.mark.parametrize("replicas", [1, 2])
def test_node_leaving_moves_only_its_objects(replicas):
    after = [n for n in NODES if n != "node-3"]
    moved = 0
    for oid in IDS:
        before_homes, after_homes = home_nodes(oid, NODES, replicas), home_nodes(oid, after, replicas)
        if "node-3" not in before_homes:
            assert after_homes == before_homes
        else:
            moved += 1
            assert set(before_homes) - {"node-3"} <= set(after_homes)
    assert moved == sum(is_home("node-3", oid, NODES, replicas) for oid in IDS)


def test_node_joining_takes_about_one_nth():
    grown = NODES + ["node-new"]
    plan = new_homes(IDS, NODES, grown)
    assert set(plan) == {"node-new"}  # nothing moves between old nodes
    share = len(plan["node-new"]) / len(IDS)
    assert abs(share - 1 / len(grown)) < 0.03


def test_new_homes_after_loss_with_replicas():
    after = [n for n in NODES if n != "node-0"]
    plan = new_homes(IDS, NODES, after, replicas=2)
    lost = [oid for oid in IDS if is_home("node-0", oid, NODES, 2)]
    assert sum(len(v) for v in plan.values()) == len(lost)
    for node, ids in plan.items():
        assert node != "node-0"
        assert all(is_home(node, oid, after, 2) for oid in ids)


def test_bad_replicas_refused():
    with pytest.raises(InvalidArgument):
        home_nodes(IDS[0], NODES, 0)
