"""A writer of store groups for test_groups.py's SIGKILL test (run as a subprocess).

    python group_writer.py SOCKET ROUND ACKS_FILE

Puts GROUPS groups of eight 1 MiB members, one after the other, appending each group's
index to ACKS_FILE (fsynced) once its put_group returned. Prints "ready" once connected; it
dies with the daemon (a DaemonUnavailable ends it).
"""

from __future__ import annotations

import os
import sys

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 3),
                os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 2)]

from kvstore import StateDescriptor  # noqa: E402
from kvstore.identity import chunk_keys  # noqa: E402
from kvs_testing import payload  # noqa: E402

GROUPS = 8
MEMBERS = 8
SIZE = 1 << 20


def items_of(round_: int, group: int) -> list:
    """Group `group` of round `round_`: seven KV layers' chunks and a state, with their bytes."""
    tokens = [round_ * 1000 + group] * 256
    out = []
    for member in range(MEMBERS):
        desc = StateDescriptor("default", "hybrid", "r1", kind="recurrent" if member == MEMBERS - 1 else "kv",
                               dtype="fp32" if member == MEMBERS - 1 else "bf16", shard=f"{member}/{MEMBERS}")
        (key,) = chunk_keys(tokens, desc)
        out.append((key, payload(SIZE, round_ * 10_000 + group * 100 + member)))
    return out


def main() -> None:
    from kvstore.client import Client
    sock, round_, acks = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with Client.connect(sock, timeout_s=10) as c, open(acks, "a") as out:
        print("ready", flush=True)
        for group in range(GROUPS):
            try:
                c.put_group(items_of(round_, group))
            except Exception:
                return
            out.write(f"{group}\n")
            out.flush()
            os.fsync(out.fileno())


if __name__ == "__main__":
    main()
