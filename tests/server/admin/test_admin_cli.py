"""`kvstore status`, `kvstore objects ...` and `kvstore evict` against a real daemon."""

from __future__ import annotations

import json

import pytest

from kvstore.commands.cli import main
from test_admin_support import admin_daemon, put_objects


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with admin_daemon(tmp_path_factory.mktemp("admin-cli")) as d:
        with d.client("cli") as client:
            d.ids = sorted(i.hex for i in put_objects(client, "cli", 3))
            assert client.get_into(d.ids[0], bytearray(100), namespace="cli") == 100
        yield d


def run(daemon, capsys, *argv) -> tuple[int, str, str]:
    code = main([*argv, "--data-dir", daemon.data_dir])
    out, err = capsys.readouterr()
    return code, out, err


def test_status_table(daemon, capsys):
    code, out, _ = run(daemon, capsys, "status")
    assert code == 0
    assert "ready" in out and "ops/s" in out
    row = next(line for line in out.splitlines() if line.startswith("cli "))
    assert "host" in row and " 3 " in row and "[" in row and "100%" in row
    from kvstore.tiers.gpu import GpuTier
    found = GpuTier.probe()
    gpu = next(line for line in out.splitlines() if line.startswith("gpu tier: "))
    assert "off ([gpu] enabled = false)" in gpu and found.reason in gpu, gpu  # the probe's finding
    assert "remote tier: none" in out  # no [cluster], no pool


def test_status_json(daemon, capsys):
    code, out, _ = run(daemon, capsys, "status", "--json")
    assert code == 0 and json.loads(out)["namespaces"]["cli"]["tiers"]["host"]["objects"] == 3
    from kvstore.tiers.gpu import GpuTier
    found = GpuTier.probe()
    assert json.loads(out)["gpu"] == {"enabled": False, "available": found.available, "reason": found.reason,
                                      "device": 0}


def test_objects_ls_and_show(daemon, capsys):
    code, out, _ = run(daemon, capsys, "objects", "ls", "--namespace", "cli")
    assert code == 0 and all(oid in out for oid in daemon.ids)
    code, out, _ = run(daemon, capsys, "objects", "ls", "--namespace", "cli", "--limit", "1", "--all", "--json")
    assert [o["object_id"] for o in json.loads(out)["objects"]] == daemon.ids
    code, out, _ = run(daemon, capsys, "objects", "ls", "--namespace", "cli", "--limit", "2")
    assert "--cursor" in out
    code, out, _ = run(daemon, capsys, "objects", "show", daemon.ids[0])
    assert code == 0 and json.loads(out)["object_id"] == daemon.ids[0]


def test_objects_pin_unpin_rm(daemon, capsys):
    oid = daemon.ids[1]
    code, out, _ = run(daemon, capsys, "objects", "pin", oid, "--ttl-s", "30")
    assert code == 0 and "pinned" in out and "30 s" in out
    assert daemon.api.get(f"/v1/objects/{oid}")["pinned"] is True
    code, out, _ = run(daemon, capsys, "objects", "pin", oid, "--unpin")
    assert code == 0 and daemon.api.get(f"/v1/objects/{oid}")["pinned"] is False
    code, out, _ = run(daemon, capsys, "objects", "rm", oid)
    assert code == 0 and "deleted" in out
    code, _, err = run(daemon, capsys, "objects", "rm", oid)
    assert code == 2 and "no object" in err


def test_evict(daemon, capsys):
    with daemon.client("cli-ev") as client:
        put_objects(client, "cli-ev", 2)
        put_objects(client, "cli-ev", 2, model="other")
    code, out, _ = run(daemon, capsys, "evict", "--namespace", "cli-ev", "--bytes", "1", "--json")
    assert code == 0 and json.loads(out)["num_evicted"] == 1
    code, out, _ = run(daemon, capsys, "evict", "--namespace", "cli-ev", "--model", "other")
    left = daemon.api.get("/v1/objects", namespace="cli-ev")["objects"]
    assert code == 0 and out.startswith("evicted") and all(o["descriptor"]["model"] == "m" for o in left)
    code, out, _ = run(daemon, capsys, "evict", "--namespace", "cli-ev", "--all")
    assert code == 0 and not daemon.api.get("/v1/objects", namespace="cli-ev")["objects"]
    code, _, err = run(daemon, capsys, "evict", "--bytes", "1")
    assert code == 2 and "namespace" in err


def test_status_without_a_daemon_says_what_to_do(tmp_path, capsys):
    assert main(["status", "--data-dir", str(tmp_path)]) == 2
    assert "admin.addr" in capsys.readouterr().err
