"""Dynamo's standalone KV indexer as the router of a test: `python -m dynamo.indexer`.

It ships in ai-dynamo-runtime (locks/dynamo.txt) and needs no NATS, etcd or GPU. It
subscribes to each registered worker's ZMQ PUB endpoint itself and reads vLLM's frames
(dynamo_kv_router's zmq_wire), keeps one index per storage tier, chosen by each event's
medium (GPU: device, CPU: host, STORAGE: disk), and answers POST /query {token_ids} with, per
worker, how many of the prompt's leading tokens it holds (`Held`). It hashes each event's
token_ids itself (xxh3 over every block_size tokens) and matches a prompt by those hashes;
block_hashes only name blocks, for removals and for the parent links that chain a prefix.

The HTTP server listens on 0.0.0.0 (the binary has no option for the address) on a port that
was free a moment before. Its log is JSON lines in a file (`log_records`), which failures quote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from dataclasses import dataclass

from kvs_testing import free_port, wait_until

MODEL = "kvstore-test"  # Dynamo keeps one index per model name; the tests register one
STARTUP_S = 30.0  # a liveness bound: the indexer answers within a second on an idle machine
HTTP_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Held:
    """How many leading tokens of a prompt a worker holds, as Dynamo's /query counts them:
    `gpu` through the device tier, `cpu` through device or host, `disk` through any of the
    three; `longest_matched` the most of these."""

    longest_matched: int = 0
    gpu: int = 0
    cpu: int = 0
    disk: int = 0


NOTHING = Held()


class DynamoIndexer:
    """One indexer process; every worker registered with it has blocks of `block_size` tokens."""

    def __init__(self, block_size: int, log_path: str):
        self.block_size = block_size
        self.port = free_port()
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "DYN_LOGGING_JSONL": "1"})
        wait_until(self._answers, STARTUP_S, f"Dynamo's indexer on port {self.port}")

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"Dynamo's indexer exited with {self.proc.returncode}: {self.log_tail()}")
        try:
            self._call("GET", "/workers")
            return True
        except OSError:
            return False

    def register(self, worker_id: int, endpoint: str, replay_endpoint: str | None = None) -> None:
        """Dynamo's listener subscribes to every topic of `endpoint` and asks `replay_endpoint`
        (vLLM's request) for batches it finds missing."""
        body = {"instance_id": worker_id, "endpoint": endpoint, "model_name": MODEL, "block_size": self.block_size}
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        self._call("POST", "/register", body)

    def held(self, tokens) -> dict[int, Held]:
        """worker id -> what it holds of the prompt `tokens`; a worker holding none of it is absent."""
        reply = self._call("POST", "/query", {"token_ids": list(tokens), "model_name": MODEL})
        return {int(worker): Held(**{name: counts[name] for name in Held.__slots__})
                for worker, counts in reply["instances"].items()}

    def log_records(self) -> list[dict]:
        with open(self.log_path, "rb") as f:
            return [json.loads(line) for line in f if line.startswith(b"{")]

    def log_tail(self, lines: int = 20) -> str:
        with open(self.log_path, "rb") as f:
            return b"".join(f.readlines()[-lines:]).decode(errors="replace")

    def _call(self, method: str, path: str, body: dict | None = None):
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as reply:
            return json.loads(reply.read())

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
