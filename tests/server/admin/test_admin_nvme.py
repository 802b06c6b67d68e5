"""The admin API and CLI over objects held only on NVMe (after a clean restart): list, show,
pin and delete reach them; status and /v1/cluster show the NVMe tier."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest

from kvstore import StateDescriptor, chunk_keys
from kvstore.identity import ObjectId
from kvstore.server.admin.client import AdminClient, AdminRequestFailed
from kvstore.commands.cli import main

NVME = {"nvme": {"enabled": True, "capacity_bytes": "64MiB", "file_bytes": "64MiB"}}
SIZE = 64 << 10


def restarted_with_cold_objects(daemon_factory, count: int = 4):
    """A daemon whose `count` objects (two models) sit only on NVMe after a clean restart."""
    d = daemon_factory("16MiB", config=NVME)
    ids = sorted((ObjectId(bytes([i + 1]) * 32) for i in range(count)), key=lambda o: o.digest)
    with d.client() as c:
        for i, oid in enumerate(ids):
            desc = StateDescriptor("default", "m-even" if i % 2 == 0 else "m-odd", "r1")
            c.put(oid, np.full(SIZE, i, np.uint8), desc)
    assert d.stop(signal.SIGTERM) == 0  # the flush writes them to NVMe
    d.start("16MiB")
    with d.client() as c:
        assert c.lookup(ids).tiers == ("nvme",) * count
    return d, ids, AdminClient.from_data_dir(d.data_dir)


def cli(d, capsys, *argv) -> tuple[int, str, str]:
    code = main([*argv, "--config", d.config_path])
    out, err = capsys.readouterr()
    return code, out, err


def test_objects_only_on_nvme_are_listed_shown_and_filtered(daemon_factory):
    d, ids, api = restarted_with_cold_objects(daemon_factory)
    page = api.get("/v1/objects")
    assert [o["object_id"] for o in page["objects"]] == [o.hex for o in ids]
    assert {(o["tier"], tuple(o["tiers"]), o["size"]) for o in page["objects"]} == {("nvme", ("nvme",), SIZE)}
    assert [o["object_id"] for o in api.get("/v1/objects", tier="nvme")["objects"]] == [o.hex for o in ids]
    assert api.get("/v1/objects", tier="host")["objects"] == []
    odd = api.get("/v1/objects", model="m-odd")["objects"]
    assert [o["object_id"] for o in odd] == [ids[1].hex, ids[3].hex]
    # Paging one at a time walks NVMe-only objects like host ones.
    seen, cursor = [], None
    while True:
        page = api.get("/v1/objects", limit=1, cursor=cursor)
        seen += [o["object_id"] for o in page["objects"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [o.hex for o in ids]
    shown = api.get(f"/v1/objects/{ids[0].hex}")
    assert shown["tiers"] == ["nvme"] and shown["descriptor"]["model"] == "m-even" and shown["pinned"] is False
    with pytest.raises(AdminRequestFailed, match="evict frees host memory only"):
        api.post("/v1/evict", {"tier": "nvme", "filter": {}})


def test_objects_only_on_nvme_can_be_pinned_and_deleted_from_the_cli(daemon_factory, capsys):
    d, ids, api = restarted_with_cold_objects(daemon_factory)
    code, out, _ = cli(d, capsys, "objects", "show", ids[0].hex)
    assert code == 0 and json.loads(out)["tiers"] == ["nvme"]
    # A pin promotes the object into host memory, then pins that copy.
    code, out, _ = cli(d, capsys, "objects", "pin", ids[0].hex, "--ttl-s", "60")
    assert code == 0 and "pinned" in out
    shown = api.get(f"/v1/objects/{ids[0].hex}")
    assert shown["tiers"] == ["host", "nvme"] and shown["tier"] == "host" and shown["pinned"] is True
    code, out, _ = cli(d, capsys, "objects", "pin", ids[1].hex, "--unpin")
    assert code == 0 and api.get(f"/v1/objects/{ids[1].hex}")["tiers"] == ["nvme"]  # nothing promoted
    code, out, _ = cli(d, capsys, "objects", "rm", ids[2].hex)
    assert code == 0 and "deleted" in out
    with d.client() as c:
        assert c.lookup([ids[2]]).tiers == (None,)
        assert c.lookup([ids[0], ids[3]]).tiers == ("host", "nvme")
        c.check_integrity()
    with pytest.raises(AdminRequestFailed, match="no object"):
        api.get(f"/v1/objects/{ids[2].hex}")
    assert [o["object_id"] for o in api.get("/v1/objects", tier="nvme")["objects"]] == [
        ids[0].hex, ids[1].hex, ids[3].hex]


def test_status_and_cluster_show_the_nvme_tier_with_one_namespace(daemon_factory, capsys):
    d, ids, api = restarted_with_cold_objects(daemon_factory)
    nvme = api.get("/v1/cluster")["nodes"][0]["tiers"]["nvme"]
    assert nvme["objects"] == len(ids) and nvme["capacity_bytes"] == 64 << 20
    code, out, _ = cli(d, capsys, "status")  # --config: the data_dir comes from the daemon's TOML
    assert code == 0
    row = next(line for line in out.splitlines() if " nvme " in line)
    assert row.startswith("(all)") and f" {len(ids)} " in row
    with d.client() as c:  # one namespace open: its host row, and still the NVMe row
        c.lookup(ids)
        c.put(ObjectId(b"\xee" * 32), np.zeros(SIZE, np.uint8))
    code, out, _ = cli(d, capsys, "status")
    assert any(line.startswith("default ") and " host " in line for line in out.splitlines())
    assert any(line.startswith("(all)") and " nvme " in line for line in out.splitlines())
    stats = api.get("/v1/stats")
    assert stats["tiers"]["host"]["allocation_unit_bytes"] == 64  # the smallest slot (tiers/slabs.py)
    assert stats["tiers"]["nvme"]["allocation_unit_bytes"] == 4096


def test_admin_lookup_after_a_restart_finds_the_nvme_objects_of_a_namespace_not_opened_since(daemon_factory):
    """Issue 41 item 12: the admin lookup answered no hits for a namespace no client had opened
    since the restart, while a client's lookup of the same chunks found them on NVMe."""
    d = daemon_factory("16MiB", config=NVME)
    desc = StateDescriptor("tenant-x", "m", "r1", chunk_tokens=16)
    tokens = list(range(4 * 16))
    keys = chunk_keys(tokens, desc)
    with d.client(namespace="tenant-x") as c:
        for i, key in enumerate(keys):
            c.put(key, np.full(SIZE, i, np.uint8))
    assert d.stop(signal.SIGTERM) == 0  # the flush writes them to NVMe
    d.start("16MiB")
    api = AdminClient.from_data_dir(d.data_dir)
    asked = {"tokens": tokens, "descriptor": desc.to_wire()}
    before = api.post("/v1/lookup", asked)  # no client has opened tenant-x since the restart
    assert "tenant-x" not in api.get("/v1/stats")["namespaces"]  # the lookup opened nothing
    with d.client(namespace="tenant-x") as c:
        seen = c.lookup(keys)
    assert seen.hits == 4 and seen.tiers == ("nvme",) * 4
    assert (before["hits"], before["tiers"], before["hit_chunks_per_tier"]) == (4, ["nvme"] * 4, {"nvme": 4})
    assert before["hit_bytes"] == 4 * SIZE
    assert api.post("/v1/lookup", asked)["tiers"] == before["tiers"]  # the same once the namespace is open


@pytest.mark.parametrize("write_policy", ["write_back", "selective"])
def test_evict_with_nvme_on_writes_objects_down_instead_of_dropping_them(daemon_factory, write_policy):
    """Issue 41 item 5: `kvstore evict` on a write_back daemon dropped every object outright
    although NVMe had room. Evicted means out of host memory, not gone."""
    d = daemon_factory("16MiB", config={"nvme": {**NVME["nvme"], "write_policy": write_policy}})
    ids = [ObjectId(bytes([i + 1]) * 32) for i in range(4)]
    with d.client() as c:
        for i, oid in enumerate(ids):
            c.put(oid, np.full(SIZE, i, np.uint8))
        assert c.lookup(ids).tiers == ("host",) * 4
    api = AdminClient.from_data_dir(d.data_dir)
    answer = api.post("/v1/evict", {"namespace": "default", "filter": {}})
    assert answer["num_evicted"] == 4
    with d.client() as c:
        assert c.lookup(ids).tiers == ("nvme",) * 4
        for i, oid in enumerate(ids):
            out = np.empty(SIZE, np.uint8)
            assert c.get_into(oid, out) == SIZE and (out == i).all()
        c.check_integrity()
