"""A daemon whose host has reserved huge pages puts its arenas there ([host] huge_pages =
"auto"): clients map them and read back exact bytes, and the stats and `kvstore status` say
which pages back each namespace."""

from __future__ import annotations

import gc
import json
import os

import numpy as np

from kvstore.commands.cli import main
from kvstore.identity import ObjectId
from kvs_testing import reserved_huge_pages
from test_admin_support import admin_daemon, descriptor


def test_a_daemon_on_reserved_huge_pages_serves_exact_bytes_and_says_so(tmp_path, capsys):
    with reserved_huge_pages(16):  # 32 MiB: the 16 MiB arena, with room
        with admin_daemon(tmp_path / "data", arena_bytes="16MiB") as d:
            data = np.frombuffer(os.urandom(3 << 20), dtype=np.uint8)
            oid = ObjectId(os.urandom(32))
            with d.client("huge") as client:
                client.put(oid, data, descriptor("huge"))
                out = np.zeros_like(data)
                assert client.get_into(oid, out, namespace="huge") == data.nbytes
                assert np.array_equal(out, data)
            stats = d.api.get("/v1/stats")
            assert stats["namespaces"]["huge"]["pages"] == "hugetlb"
            assert main(["status", "--data-dir", d.data_dir]) == 0
            row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("huge "))
            assert row.endswith("huge (reserved)"), row
        del client
        gc.collect()  # the client's mapping of the arena goes with it, and the pages with that


def test_without_reserved_pages_the_status_says_which_pages(tmp_path, capsys):
    with admin_daemon(tmp_path / "data") as d:
        with d.client("plain") as client:
            client.put(ObjectId(os.urandom(32)), b"x" * 100, descriptor("plain"))  # makes the arena
        assert main(["status", "--json", "--data-dir", d.data_dir]) == 0
        pages = json.loads(capsys.readouterr().out)["namespaces"]["plain"]["pages"]
        with open("/proc/meminfo") as f:
            reserved = any(line.startswith("HugePages_Free:") and int(line.split()[1]) for line in f)
        assert pages in (("hugetlb", "thp", "off") if reserved else ("thp", "off"))
