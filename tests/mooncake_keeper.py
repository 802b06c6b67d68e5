"""A Mooncake client of its own, run as a process by tests/mooncake_helpers.py: it lends the
pool its memory (the pool's only segment, so daemons may come and go) and does what a test
asks with Mooncake's own client, one JSON line per command on stdin, one answer per line.

    {"op": "get", "key": k}                       -> {"data": base64 | null}
    {"op": "put", "key": k, "data": base64}       -> {"rc": int}
    {"op": "remove", "key": k}                    -> {"rc": int}
    {"op": "exist", "keys": [k, ...]}             -> {"codes": [int, ...]}
    {"op": "fill", "bytes": n}                    -> {"stored": bytes}  (hard-pinned, until full)

argv: master rpc address, segment bytes.
"""

import base64
import json
import os
import sys

import numpy as np
from mooncake.store import MooncakeDistributedStore, ReplicateConfig


def main() -> None:
    master, segment = sys.argv[1], int(sys.argv[2])
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # Mooncake's own output must not mix with the answers
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 << 20, "tcp", "", master)
    print(json.dumps({"ready": rc == 0, "rc": rc}), file=out, flush=True)
    pinned = ReplicateConfig()
    pinned.replica_num, pinned.with_hard_pin = 1, True
    num_fill = 0
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "get":
            size = store.get_size(cmd["key"])
            data = store.get(cmd["key"]) if size > 0 else b""
            answer = {"data": base64.b64encode(data).decode() if data else None}
        elif op == "put":
            answer = {"rc": store.put(cmd["key"], base64.b64decode(cmd["data"]))}
        elif op == "remove":
            answer = {"rc": store.remove(cmd["key"], True)}
        elif op == "exist":
            answer = {"codes": list(store.batch_is_exist(cmd["keys"]))}
        elif op == "fill":  # hard-pinned objects the pool can never evict, halving on refusal
            stored, size = 0, cmd["bytes"]
            chunk = np.ones(size, dtype=np.uint8)
            store.register_buffer(chunk.ctypes.data, chunk.nbytes)
            while size >= 4096:
                num_fill += 1
                if store.put_from(f"fill/{num_fill}", chunk.ctypes.data, size, pinned) == 0:
                    stored += size
                else:
                    size //= 2
            answer = {"stored": stored}
        else:
            answer = {"error": f"unknown op {op}"}
        print(json.dumps(answer), file=out, flush=True)


if __name__ == "__main__":
    main()
