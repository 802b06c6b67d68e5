"""A connection to the daemon that fails soft: the connector's only way to reach the store.

`call(op)` runs op(client) and returns its result, or None when the store failed (daemon down
or restarted, timeout, checksum, full): the caller then recomputes. A connection that dies
under a call (a restarted daemon) gets one fresh reconnect before the call counts as failed;
after a failure the link stays down for `retry_after_s` (no connect attempts, no exports), then
reconnects on the next call. One thread uses a link.
"""

from __future__ import annotations

import logging
import time

from kvstore.errors import KVStoreError
from kvstore.client.sync import Client

_log = logging.getLogger("kvstore.connector")


class StoreLink:
    def __init__(self, socket_path: str | None, namespace: str, timeout_s: float, retry_after_s: float):
        self.socket_path = socket_path
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.num_errors = 0
        self.last_error = ""
        self._client: Client | None = None
        self._down_until = 0.0

    @property
    def down(self) -> bool:
        """True while the link waits out retry_after_s after a failure."""
        return self._client is None and time.monotonic() < self._down_until

    def call(self, op):
        for attempt in (0, 1):
            fresh = self._client is None
            if fresh:
                if self.down:
                    return None
                try:
                    self._client = Client(self.socket_path, namespace=self.namespace,
                                          timeout_s=self.timeout_s, client_name="kv-connector")
                except (KVStoreError, OSError) as exc:
                    return self._failed(exc)
            try:
                return op(self._client)
            except (KVStoreError, OSError) as exc:
                if fresh or attempt:
                    return self._failed(exc)
                self.close()  # a held connection died: try one fresh one
        return None

    def _failed(self, exc: Exception) -> None:
        self.num_errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        _log.warning("store unavailable, recomputing: %s", self.last_error)
        self.close()
        self._down_until = time.monotonic() + self.retry_after_s
        return None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
