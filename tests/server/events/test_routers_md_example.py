"""The "A subscriber in Python" example of docs/routers.md, run as the docs give it (issue 41,
item 10): only its two endpoints are pointed at the test's daemon. It must end with exactly
what the daemon holds after a SIGKILL and after a SIGTERM restart, and its ask() must give up
on a daemon that never answers instead of waiting forever. The docs cannot drift from this.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading

import pytest

from kvs_events import last_seq, vllm_int_hash
from kvs_testing import wait_until
from kvstore.identity import ObjectId

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "routers.md"
DOCUMENTED_DIR = "ipc:///var/lib/kvstore/"  # where the example's endpoints point
CONFIG = {"events": {"enabled": True, "heartbeat_s": 0.2}}  # the defaults, heartbeats more often
LIVENESS_S = 60.0  # a bound on the example catching up: seconds on an idle machine, never a timing
# Runs the example as __main__ in its own globals and, for each line on stdin, prints what it
# holds (medium -> block hashes) and the last batch number it applied, as JSON.
RUNNER = """
import json, sys, threading
source, scope = open(sys.argv[1]).read(), {"__name__": "__main__"}

def report():
    for _ in sys.stdin:
        held = {medium: sorted(hashes) for medium, hashes in list(scope.get("held", {}).items()) if hashes}
        print(json.dumps({"held": held, "last": scope.get("last")}), flush=True)

threading.Thread(target=report, daemon=True).start()
exec(compile(source, "docs/routers.md", "exec"), scope)
"""


def example_for(d) -> str:
    """The documented block, its endpoints moved to `d`'s data directory."""
    section = DOC.read_text().split("## A subscriber in Python", 1)[1]
    source = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert source.count(DOCUMENTED_DIR) == 2, "the example names its two endpoints in /var/lib/kvstore"
    return source.replace(DOCUMENTED_DIR, f"ipc://{d.data_dir}/")


class RunningExample:
    def __init__(self, d, tmp_path):
        (tmp_path / "example.py").write_text(example_for(d))
        (tmp_path / "runner.py").write_text(RUNNER)
        self.proc = subprocess.Popen([sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "example.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def state(self) -> dict:
        if self.proc.poll() is not None:
            raise AssertionError(f"the example exited with {self.proc.returncode}")
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def ends_with(self, hashes: set, last: int, what: str) -> None:
        """Wait until the example holds exactly `hashes` in CPU, having applied batch `last`."""
        want, seen = {"CPU": sorted(hashes)}, {}

        def done() -> bool:
            seen.update(self.state())
            return seen["held"] == want and seen["last"] is not None and seen["last"] >= last
        try:
            wait_until(done, LIVENESS_S, what)
        except AssertionError:
            raise AssertionError(f"{what}: the example should hold {want} as of batch {last}; it has {seen}") from None

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def put_new(d, n: int) -> tuple[set, int]:
    """n new objects in `default`: their block hashes as published, and the last batch number."""
    keys = [ObjectId(os.urandom(32)) for _ in range(n)]
    with d.client() as c:
        for key in keys:
            c.put(key, b"x" * 100)
        return {vllm_int_hash(k) for k in keys}, last_seq(c, "default")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_documented_subscriber_ends_with_the_new_daemons_blocks_after_a_restart(daemon_factory, tmp_path, sig):
    d = daemon_factory("16MiB", config=CONFIG)
    old, old_last = put_new(d, 5)  # before the example starts: its snapshot has them
    example = RunningExample(d, tmp_path)
    try:
        example.ends_with(old, old_last, "before the restart")
        assert d.stop(sig) is not None
        d.start("16MiB")
        new, new_last = put_new(d, 3)
        example.ends_with(new, new_last, f"after a restart by {signal.Signals(sig).name}")
    finally:
        example.close()


def test_the_documented_ask_gives_up_on_a_daemon_that_never_answers(daemon_factory):
    d = daemon_factory("16MiB", config=CONFIG)
    scope = {"__name__": "routers_md"}  # its definitions and sockets, not its loop
    loader = threading.Thread(target=exec, args=(compile(example_for(d), "docs/routers.md", "exec"), scope),
                              daemon=True)
    loader.start()
    loader.join(LIVENESS_S)
    assert not loader.is_alive(), "imported, the example runs its loop: keep that under __main__"
    outcome = []
    try:
        assert scope["snapshot"]() == -1  # connected, answered: the default namespace published nothing
        scope["ASK_TRIES"], scope["ASK_TIMEOUT_MS"] = 2, 200
        os.kill(d.proc.pid, signal.SIGSTOP)  # it holds the request and never answers
        asker = threading.Thread(target=lambda: outcome.append(_raised(scope["snapshot"])), daemon=True)
        asker.start()
        asker.join(LIVENESS_S)
        assert not asker.is_alive(), "ask() still waits for a daemon that never answers"
        assert outcome == ["TimeoutError"]
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
        if outcome:  # a thread still in ask() would hold the sockets
            scope["sub"].close(linger=0)
            scope["replay"].close(linger=0)
            scope["ctx"].term()


def _raised(call) -> str | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test names what it expects
        return type(exc).__name__
    return None
