"""Start-up of a real daemon process: what it refuses (one line, non-zero exit, nothing made)
and what stops it (SIGTERM during a long prefault)."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest


SERVE = [sys.executable, "-m", "kvstore.commands.cli", "serve"]
# Not a timing threshold: only how long a test waits before calling the daemon hung.
HANG_S = 120


@pytest.fixture
def root():
    path = tempfile.mkdtemp(prefix="kvs-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def serve(*args, timeout=HANG_S) -> subprocess.CompletedProcess:
    """`kvstore serve` that is expected to refuse: it must exit by itself."""
    proc = subprocess.Popen([*SERVE, "--admin-port", "0", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the daemon started instead of refusing")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def serve_until_then_stop(d, started) -> str:
    """`kvstore serve` logging to a file until `started(log text)`, then SIGTERM: it must exit 0.
    The log file's path."""
    log_path = os.path.join(d.root, "daemon.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*SERVE, "--config", d.config_path, "--socket", d.socket, "--log-level", "info"],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + HANG_S
        while not started(open(log_path).read()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started(open(log_path).read()) and proc.poll() is None, open(log_path).read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(HANG_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return log_path


def assert_one_line_refusal(result, *words):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_second_daemon_on_the_same_data_dir_is_refused_and_the_first_keeps_its_admin_addr(daemon):
    addr_path = os.path.join(daemon.data_dir, "admin.addr")
    with open(addr_path) as f:
        addr = f.read()
    other_socket = os.path.join(daemon.root, "other.sock")
    result = serve("--config", daemon.config_path, "--socket", other_socket, "--arena-bytes", "1MiB")
    assert_one_line_refusal(result, daemon.data_dir, f"pid {daemon.proc.pid}")
    with open(addr_path) as f:
        assert f.read() == addr
    assert not os.path.exists(other_socket)
    with daemon.client() as c:
        c.stats()


def test_the_data_dir_lock_goes_with_its_daemon(daemon):
    """A daemon killed with SIGKILL leaves the lock file; the next one starts all the same."""
    daemon.stop(signal.SIGKILL)
    assert os.path.exists(os.path.join(daemon.data_dir, "daemon.lock"))
    daemon.start()
    with daemon.client() as c:
        c.stats()


@pytest.mark.parametrize("where", ["file", "under_file", "proc"])
def test_unusable_data_dir_is_one_line_not_a_traceback(root, where):
    a_file = os.path.join(root, "a_file")
    open(a_file, "w").close()
    data_dir = {"file": a_file, "under_file": os.path.join(a_file, "data"), "proc": "/proc/kvstore-test"}[where]
    result = serve("--data-dir", data_dir, "--socket", os.path.join(root, "s"), "--arena-bytes", "1MiB")
    assert_one_line_refusal(result, data_dir)
    assert not os.path.exists(os.path.join(root, "s"))


@pytest.mark.parametrize("mode", [0o1777, 0o770, 0o702])
def test_a_data_dir_others_can_write_is_refused_and_left_as_it_was(root, mode):
    shared = os.path.join(root, "shared")
    os.mkdir(shared)
    os.chmod(shared, mode)  # e.g. a /tmp-like directory with another user's file in it
    theirs = os.path.join(shared, "someone-elses-file")
    with open(theirs, "w") as f:
        f.write("theirs")
    result = serve("--data-dir", shared, "--socket", os.path.join(root, "s"), "--arena-bytes", "1MiB")
    assert_one_line_refusal(result, shared)
    assert f"mode {mode:o}" in result.stderr and "others can write" in result.stderr
    assert (os.stat(shared).st_mode & 0o7777) == mode  # never narrowed
    assert sorted(os.listdir(shared)) == ["someone-elses-file"] and open(theirs).read() == "theirs"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_data_dir_of_another_user_is_refused(root):
    theirs = os.path.join(root, "theirs")
    os.mkdir(theirs, 0o700)
    os.chown(theirs, 65534, 65534)
    result = serve("--data-dir", theirs, "--socket", os.path.join(root, "s"), "--arena-bytes", "1MiB")
    assert_one_line_refusal(result, theirs)
    assert "belongs to uid 65534" in result.stderr
    assert os.listdir(theirs) == [] and os.stat(theirs).st_uid == 65534


def test_two_daemons_started_together_on_one_socket_leave_one_serving(root):
    """Both once passed the 'already serving' check (it ran before the arenas were made, the
    bind after), both logged ready, and the orphaned one's SIGTERM deleted the socket. Which
    one wins is a race (the second may import faster); exactly one must."""
    sock = os.path.join(root, "s")
    procs = []
    for i in range(2):
        procs.append(subprocess.Popen([*SERVE, "--admin-port", "0", "--socket", sock, "--arena-bytes", "128MiB",
                                       "--data-dir", os.path.join(root, f"data{i}")],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      stdin=subprocess.DEVNULL))
        time.sleep(0.05)
    try:
        deadline = time.monotonic() + HANG_S
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        ended = [i for i, p in enumerate(procs) if p.poll() is not None]
        assert len(ended) == 1, "neither daemon was refused"
        loser, winner = procs[ended[0]], procs[1 - ended[0]]
        _, err = loser.communicate(timeout=HANG_S)
        assert loser.returncode != 0 and sock in err and f"(pid {winner.pid})" in err
        from kvstore.client import Client
        while not os.path.exists(sock) and time.monotonic() < deadline:
            time.sleep(0.05)
        with Client.connect(sock) as c:
            c.put(bytes(range(32)), b"still served")
        assert winner.poll() is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.communicate(timeout=HANG_S)
    assert winner.returncode == 0 and not os.path.exists(sock)


def test_a_busy_lock_names_its_holder_even_when_asked_before_the_holder_wrote_its_pid(root):
    """The holder writes its pid just after it takes the lock; a second daemon refused in
    between waits for it rather than naming "pid unknown" (the test above once met this)."""
    import fcntl
    import threading
    from kvstore.server.data_dir import HeldLock
    path = os.path.join(root, "s.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, and the file still empty
    late = threading.Timer(0.1, lambda: os.pwrite(fd, b"4242\n", 0))
    late.start()
    try:
        with pytest.raises(RuntimeError, match="held by 4242$"):
            HeldLock(path, RuntimeError, "held by {pid}")
        late.join()
        os.ftruncate(fd, 0)  # a holder that never writes one: named unknown, not waited on forever
        with pytest.raises(RuntimeError, match="held by unknown$"):
            HeldLock(path, RuntimeError, "held by {pid}")
    finally:
        late.join()
        os.close(fd)


def test_a_socket_lock_that_cannot_be_made_is_one_line(root):
    os.mkdir(os.path.join(root, "s.lock"))  # in the lock file's place
    result = serve("--socket", os.path.join(root, "s"), "--data-dir", os.path.join(root, "data"),
                   "--arena-bytes", "1MiB")
    assert_one_line_refusal(result, "s.lock", "Is a directory")


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o730])
def test_a_socket_directory_others_can_write_is_refused(root, mode):
    shared = os.path.join(root, "run")
    os.mkdir(shared)
    os.chmod(shared, mode)
    result = serve("--socket", os.path.join(shared, "s"), "--data-dir", os.path.join(root, "data"),
                   "--arena-bytes", "1MiB")
    assert_one_line_refusal(result, shared, f"mode {mode:o}")
    assert os.listdir(shared) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_socket_directory_of_another_user_is_refused(root):
    """/tmp/kvstore-<uid> made first by someone else: its owner could listen at the path."""
    theirs = os.path.join(root, "kvstore-0")
    os.mkdir(theirs, 0o700)
    os.chown(theirs, 65534, 65534)
    result = serve("--socket", os.path.join(theirs, "kvstore.sock"), "--data-dir", os.path.join(root, "data"),
                   "--arena-bytes", "1MiB")
    assert_one_line_refusal(result, theirs, "belongs to uid 65534")


def test_arena_beyond_the_machines_memory_is_refused_naming_the_key(root):
    result = serve("--data-dir", os.path.join(root, "data"), "--socket", os.path.join(root, "s"),
                   "--arena-bytes", "64TiB")
    assert_one_line_refusal(result, "host.arena_bytes", "memory")
    assert not os.path.exists(os.path.join(root, "data"))  # refused before anything was made


def test_prefaulted_namespaces_beyond_available_memory_are_refused(unstarted_daemon):
    """Each arena fits, but host.namespaces of them prefaulted at start would not."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    arena = (total // 2) // 4096 * 4096
    d = unstarted_daemon({"host": {"arena_bytes": arena, "namespaces": ["a", "b", "c"]}})
    result = serve("--config", d.config_path, "--socket", d.socket)
    assert_one_line_refusal(result, "host.arena_bytes", "host.namespaces", "available")


def test_bad_config_is_refused_before_the_admin_api_starts(unstarted_daemon):
    d = unstarted_daemon({"host": {"policy": "lfu"}})
    result = serve("--config", d.config_path, "--socket", d.socket)
    assert_one_line_refusal(result, "host.policy", "lfu")
    assert not os.path.exists(os.path.join(d.data_dir, "admin.addr"))
    assert not os.path.exists(os.path.join(d.data_dir, "admin.token"))


def test_a_limit_that_would_refuse_every_put_is_refused_at_start_naming_the_key(unstarted_daemon):
    """Issue 41 item 16: limits.max_inflight_bytes_per_client = 1 started a daemon whose every
    put then failed with LimitExceeded."""
    d = unstarted_daemon({"limits": {"max_inflight_bytes_per_client": 1}})
    result = serve("--config", d.config_path, "--socket", d.socket)
    assert_one_line_refusal(result, "limits.max_inflight_bytes_per_client", ">= 1048576", "got 1")
    assert not os.path.exists(d.socket)


def test_sigterm_during_a_long_prefault_stops_the_daemon(unstarted_daemon):
    """It used to prefault the whole arena first (2 s per GiB here, and more than RAM took the
    OOM killer to others first), then stop. Now SIGTERM interrupts the prefault."""
    d = unstarted_daemon({"host": {"arena_bytes": "2GiB", "prefault": True}})
    addr = os.path.join(d.data_dir, "admin.addr")
    # the admin API starts before the arenas are made
    log_path = serve_until_then_stop(d, lambda text: os.path.exists(addr))
    text = open(log_path).read()
    assert "event=start_interrupted" in text and "event=ready" not in text, text
    assert "Traceback" not in text
    assert not os.path.exists(d.socket)
    assert not os.path.exists(addr)


def test_nvme_path_that_is_a_file_is_one_line(unstarted_daemon, root):
    a_file = os.path.join(root, "a_file")
    open(a_file, "w").close()
    d = unstarted_daemon({"nvme": {"enabled": True, "path": a_file, "capacity_bytes": "16MiB", "file_bytes": "16MiB"}})
    result = serve("--config", d.config_path, "--socket", d.socket, "--arena-bytes", "1MiB")
    assert_one_line_refusal(result, "nvme.path", a_file)


def test_gpu_tier_enabled_where_cuda_cannot_run_is_refused_with_the_probes_reason(unstarted_daemon):
    from kvstore.tiers.gpu import GpuTier
    if GpuTier.probe().available:
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    d = unstarted_daemon({"gpu": {"enabled": True, "capacity_bytes": "64MiB"}})
    result = serve("--config", d.config_path, "--socket", d.socket, "--arena-bytes", "1MiB")
    assert_one_line_refusal(result, "[gpu] enabled = true", GpuTier.probe().reason, "enabled = false")
    assert not os.path.exists(d.socket)


def test_a_gpu_capacity_that_is_no_multiple_of_256_is_refused_naming_the_key(unstarted_daemon):
    d = unstarted_daemon({"gpu": {"enabled": True, "capacity_bytes": 1000}})
    result = serve("--config", d.config_path, "--socket", d.socket)
    assert_one_line_refusal(result, "gpu.capacity_bytes", "256")


def test_the_ready_line_says_what_the_gpu_probe_found(unstarted_daemon):
    from kvstore.tiers.gpu import GpuTier
    d = unstarted_daemon({"host": {"arena_bytes": "1MiB"}})
    log_path = serve_until_then_stop(d, lambda text: "event=ready" in text)
    ready = next(line for line in open(log_path).read().splitlines() if "event=ready" in line)
    assert "gpu=off" in ready and repr(GpuTier.probe().reason) in ready, ready
