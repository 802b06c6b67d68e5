"""Faults: injected EIO, ENOSPC and short reads/writes in the NVMe tier, SIGKILL of the
daemon under load (writers and readers, NVMe on), SIGKILL of clients under load.

After each: no wrong bytes served, no leaked extents or leases (check_integrity, which
also checks the NVMe allocators against the index), and the daemon serving.
Covered elsewhere: a full disk (tests/server/tiering/test_nvme_daemon.py::test_full_disk...), a
flipped byte on disk, SIGKILL during a pure write storm.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

import kvstore.tiers.nvme.files as nvme_files
from fault_injection import FaultyOs, InProcessDaemon, Rates
from hardening_support import CHILD_ENV, HERE, assert_clean, content, key, nvme, read_state, size_of, wait_for
from kvstore.config import ServerConfig
from kvstore.errors import ServiceError

WORKERS = os.path.join(HERE, "workers.py")


def inprocess(tmp_path, **nvme_overrides) -> InProcessDaemon:
    config = ServerConfig.from_dict({
        "data_dir": str(tmp_path / "data"), "socket_path": str(tmp_path / "s.sock"),
        "host": {"arena_bytes": "4MiB"}, "admin": {"enabled": False},
        "nvme": nvme(capacity_bytes="64MiB", file_bytes="16MiB", admit_min_hits=0, **nvme_overrides),
    })
    return InProcessDaemon(config).start()


def put_all(c, tag: str, n: int, size: int = 600 * 1024) -> list:
    keys = [key(tag, i) for i in range(n)]
    for k in keys:
        c.put(k, content(k, size_of(k, 4096, size)))
    return keys


def states(c, keys, size: int = 600 * 1024) -> dict:
    out = {"ok": 0, "missing": 0, "WRONG": 0, "error": 0}
    for k in keys:
        try:
            out[read_state(c, k, size_of(k, 4096, size))] += 1
        except ServiceError:  # an I/O error is reported as one, never as bytes
            out["error"] += 1
    return out


def nvme_stats(c) -> dict:
    return c.stats()["tiers"]["nvme"]


@pytest.fixture
def faulty_os(monkeypatch):
    def install(rates: Rates) -> FaultyOs:
        fake = FaultyOs(rates, seed=1)
        monkeypatch.setattr(nvme_files, "os", fake)  # only the tier's own I/O calls see it
        return fake
    return install


def test_short_writes_and_reads_are_completed_never_served_torn(tmp_path, faulty_os):
    fake = faulty_os(Rates(short_write=0.5, short_read=0.5))
    d = inprocess(tmp_path)
    try:
        with d.client() as c:
            keys = put_all(c, "short", 24)  # 14 MiB through a 4 MiB host tier: most go to NVMe
            for _ in range(2):
                assert states(c, keys) == {"ok": 24, "missing": 0, "WRONG": 0, "error": 0}
            assert fake.injected["short_write"] > 0 and fake.injected["short_read"] > 0
            assert nvme_stats(c)["num_checksum_failures"] == 0
            c.check_integrity()
            assert c.stats()["leases"] == 0
    finally:
        d.stop()


def test_write_errors_cost_objects_not_bytes_and_leak_nothing(tmp_path, faulty_os):
    fake = faulty_os(Rates(write_eio=0.2, write_enospc=0.1, sync_eio=0.1))
    d = inprocess(tmp_path, write_policy="write_through")
    try:
        with d.client() as c:
            keys = put_all(c, "eio", 32)  # every put answers; a failed NVMe copy says "memory"
            seen = states(c, keys)
            assert seen["WRONG"] == 0 and seen["ok"] + seen["missing"] == 32
            assert nvme_stats(c)["num_demotion_failures"] > 0 and nvme_stats(c)["num_io_errors"] > 0
            c.check_integrity()
            fake.rates = Rates()  # the disk recovers: the tier works again, nothing stuck
            more = put_all(c, "after", 8)
            assert states(c, more)["ok"] == 8
            before = {k: read_state(c, k, size_of(k, 4096, 600 * 1024)) for k in keys + more}
            c.check_integrity()
            assert c.stats()["leases"] == 0
    finally:
        d.stop()
    assert sum(fake.injected.values()) > 0
    d = inprocess(tmp_path, write_policy="write_through")  # a clean restart keeps what was there
    try:
        with d.client() as c:
            assert d.daemon.recovery["dropped"] == 0
            for k, state in before.items():
                assert read_state(c, k, size_of(k, 4096, 600 * 1024)) == ("ok" if state == "ok" else "missing")
            c.check_integrity()
    finally:
        d.stop()


def test_read_errors_are_errors_or_misses_never_wrong_bytes(tmp_path, faulty_os):
    fake = faulty_os(Rates())
    d = inprocess(tmp_path)
    try:
        with d.client() as c:
            keys = put_all(c, "readerr", 24)
            fake.rates = Rates(read_eio=0.3)
            seen = states(c, keys)
            assert seen["WRONG"] == 0 and seen["error"] > 0
            c.check_integrity()  # a failed promotion gives its host extent back
            fake.rates = Rates()
            assert states(c, keys) == {"ok": 24, "missing": 0, "WRONG": 0, "error": 0}  # nothing was dropped
            c.check_integrity()
            assert c.stats()["leases"] == 0
    finally:
        d.stop()


def _spawn(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKERS, *map(str, args)], env=CHILD_ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.mark.parametrize("round_", range(2))
def test_sigkill_of_the_daemon_under_reads_and_writes_then_restart(make_daemon, tmp_path, round_):
    d = make_daemon({"nvme": nvme(write_policy="write_through")}, arena_bytes="8MiB")
    acks, bad = tmp_path / "acks", tmp_path / "bad"
    acks.touch()
    workers = [_spawn("writer", d.socket, acks)] + [_spawn("reader", d.socket, acks, bad) for _ in range(2)]
    try:
        assert wait_for(lambda: len(acks.read_text().splitlines()) >= 40, timeout=60)
        # A reader still starting (imports on a loaded machine) when the daemon dies never reads.
        ready = tmp_path / "bad.ready"
        assert wait_for(lambda: ready.exists() and len(ready.read_text().splitlines()) >= 2, timeout=60), \
            "the readers never read"
        time.sleep(random.Random(round_).uniform(0, 0.5))
        d.stop(signal.SIGKILL)
        for w in workers:
            w.wait(30)
    finally:
        for w in workers:
            w.kill()
    lines = bad.read_text().splitlines()
    assert len(lines) == 2 and all(line.startswith("reads ") for line in lines), f"wrong bytes served: {lines}"
    assert all(int(line.split()[1]) > 0 for line in lines)  # both readers read while the writer wrote
    durable = [int(line.split()[0]) for line in acks.read_text().splitlines() if line.endswith(" sync")]
    assert len(durable) >= 40
    d.start()
    with d.client() as c:
        for i in durable:
            k = key("storm", i)
            assert read_state(c, k, size_of(k)) == "ok", f"acknowledged durable put {i} lost or wrong"
        assert_clean(d, c)


def test_sigkill_of_clients_under_load_leaks_nothing(make_daemon, tmp_path):
    d = make_daemon({"nvme": nvme(), "limits": {"max_inflight_bytes_per_client": "2MiB"}}, arena_bytes="8MiB")
    rng = random.Random(7)
    result = str(tmp_path / "mixed")
    running, killed, leases_at_kill = [], 0, 0
    try:
        for wave in range(3):
            running += [_spawn("mixed", d.socket, rng.randrange(10**6), 120, 64, result) for _ in range(4 - len(running))]
            time.sleep(rng.uniform(1.5, 3.0))
            # Kill only once they hold something: a slow machine may still be starting them.
            seen = []

            def holding() -> bool:
                seen.append(d.admin().get("/v1/stats")["leases"])
                return seen[-1] > 0

            assert wait_for(holding, timeout=60), "the clients never took a lease"
            leases_at_kill += seen[-1]
            for w in rng.sample(running, 2 if wave < 2 else len(running)):
                w.send_signal(signal.SIGKILL)
                w.wait(10)
                running.remove(w)
                killed += 1
    finally:
        for w in running:
            w.kill()
    assert killed == 8 and leases_at_kill > 0  # they died holding leases and reservations
    assert not os.path.exists(result + ".bad") or open(result + ".bad").read() == "", "wrong bytes served"
    with d.client() as c:
        seen = states(c, [key("soak", i) for i in range(64)], 512 * 1024)
        assert seen["WRONG"] == 0 and seen["error"] == 0 and seen["ok"] > 0
        stats = assert_clean(d, c)
        assert stats["leases"] == 0
    assert d.alive()
