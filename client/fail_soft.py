"""A connection to the daemon that fails soft: the engine side's only way to reach the store.

Both engine connectors use it: the reference engine's (`gpu/engine/connector.py`) and the
adapters' store handle (`adapters/common.py: SafeStore`). `call(op, fallback)` runs op(client)
and returns its result, or `fallback` when the call did not get an answer it can use:

- the store failed (daemon down or restarted, timeout, checksum, full): counted in
  `num_errors` (with `last_error`) and logged; the link then stays down for `retry_after_s`
  (no connect attempts; `down` tells callers to skip work such as exports), and the next call
  after that reconnects. A connection that dies under a call (a restarted daemon) gets one
  fresh reconnect before the call counts as failed.
- the store refused the request as wrong (InvalidArgument: a bad buffer, a size that does not
  match): counted in `num_refused` and logged, but not an outage: the link stays up.

`num_failures` counts the calls answered with their fallback because the store failed or the
link was down (a refusal is not one). The caller then recomputes. The link is thread-safe: one
lock around one connection (engines call their storage from scheduler, worker and I/O threads).
"""

from __future__ import annotations

import logging
import threading
import time

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.client.sync import Client

_log = logging.getLogger("kvstore.client.fail_soft")
_FAILED = object()  # the store failed, or the link is down: the call's fallback


class FailSoftLink:
    def __init__(self, socket_path: str | None, namespace: str, timeout_s: float, retry_after_s: float):
        self.socket_path = socket_path
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.num_errors = 0  # store failures: each takes the link down for retry_after_s
        self.num_failures = 0  # calls answered with their fallback because the store failed or was down
        self.num_refused = 0  # calls the store refused as invalid (answered with their fallback)
        self.last_error = ""  # the last store failure
        self._client: Client | None = None
        self._down_until = 0.0
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        """True while the link waits out retry_after_s after a failure."""
        return self._client is None and time.monotonic() < self._down_until

    def call(self, op, fallback=None):
        """op(client)'s result, or `fallback` (see the module docstring)."""
        with self._lock:
            try:
                result = self._run(op)
            except InvalidArgument as exc:
                self.num_refused += 1
                _log.warning("kvstore refused a request: %s", exc)
                return fallback
            if result is _FAILED:
                self.num_failures += 1
                return fallback
            return result

    def _run(self, op):
        """op(client), or _FAILED; an InvalidArgument that op raises goes to the caller."""
        for retry in (False, True):
            if self._client is None:
                if self.down:
                    return _FAILED
                try:
                    self._client = Client(self.socket_path, namespace=self.namespace,
                                          timeout_s=self.timeout_s, client_name="kv-connector")
                except (KVStoreError, OSError) as exc:
                    return self._failed(exc)
                retry = True  # a fresh connection gets no second one
            try:
                return op(self._client)
            except InvalidArgument:
                raise  # a refusal: the store is up
            except (KVStoreError, OSError) as exc:
                if retry:
                    return self._failed(exc)
                self._drop()  # a held connection died: try one fresh one
        return _FAILED

    def _failed(self, exc: Exception):
        self.num_errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        _log.warning("store unavailable, recomputing: %s", self.last_error)
        self._drop()
        self._down_until = time.monotonic() + self.retry_after_s
        return _FAILED

    def _drop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def stats(self) -> dict:
        return {"num_failures": self.num_failures, "num_refused": self.num_refused, "last_error": self.last_error}

    def close(self) -> None:
        with self._lock:
            self._drop()
