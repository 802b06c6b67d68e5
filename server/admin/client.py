"""A small blocking client for the admin API, used by the `kvstore` CLI (and tests).

It finds the daemon through its data directory: <data_dir>/admin.addr holds the URL the
daemon bound, <data_dir>/admin.token the bearer token. Standard library only.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request

from kvstore.config import default_data_dir
from kvstore.errors import DaemonUnavailable, KVStoreError

ADDR_FILE = "admin.addr"
TOKEN_FILE = "admin.token"


class AdminRequestFailed(KVStoreError):
    """The admin API answered with an error; `status` is the HTTP status, `code` its error code."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status = status
        self.code = code


class AdminClient:
    """One admin API endpoint and its token. Every call returns the decoded JSON answer."""

    def __init__(self, url: str, token: str | None, timeout_s: float = 30.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    @classmethod
    def from_data_dir(cls, data_dir: str | None = None, url: str | None = None,
                      token: str | None = None) -> AdminClient:
        """Read the URL and token a daemon left in `data_dir` (default: the config default)."""
        data_dir = data_dir or default_data_dir()
        if url is None:
            url = _read(os.path.join(data_dir, ADDR_FILE), "is the daemon running with this --data-dir?")
        if token is None:
            token = _read(os.path.join(data_dir, TOKEN_FILE), "the daemon writes it at first start")
        return cls(url, token)

    def request(self, method: str, path: str, query: dict | None = None, body=None, raw: bool = False):
        query = {k: v for k, v in (query or {}).items() if v is not None}
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as exc:
            raise _failure(exc) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise DaemonUnavailable(f"cannot reach the admin API at {self.url} ({reason}); "
                                    "is the daemon running?") from None
        return payload.decode() if raw else json.loads(payload)

    def get(self, path: str, **query):
        return self.request("GET", path, query)

    def post(self, path: str, body=None, **query):
        return self.request("POST", path, query, body)

    def delete(self, path: str, **query):
        return self.request("DELETE", path, query)


def _read(path: str, hint: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        raise DaemonUnavailable(f"{path} does not exist; {hint}") from None
    except PermissionError:
        raise DaemonUnavailable(f"cannot read {path}: run as the daemon's user") from None


def _failure(exc: urllib.error.HTTPError) -> AdminRequestFailed:
    try:
        error = json.loads(exc.read())["error"]
        return AdminRequestFailed(exc.code, str(error["code"]), str(error["message"]))
    except (ValueError, KeyError, TypeError):
        return AdminRequestFailed(exc.code, "http_error", f"HTTP {exc.code} {exc.reason}")
