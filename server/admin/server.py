"""The admin REST API server (docs/admin-api.md): aiohttp on the daemon's own event loop.

At start it binds admin.host:admin.port (port 0: any free port) and writes the URL it got
to <data_dir>/admin.addr. A bearer token is generated at first start into
<data_dir>/admin.token (mode 0600) and reused after; every route except /healthz needs
`Authorization: Bearer <token>`. Handlers run on the event loop thread, the only thread
that may touch the tier manager. Routes live in server/admin/routes.py and
server/admin/objects.py, their OpenAPI description in server/admin/openapi.py.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import os
import re
import secrets
import time
from collections import Counter

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong

from kvstore.errors import KVStoreError, ServiceError
from kvstore.server.admin.http import (
    ADMIN,
    HTTP_CODES,
    MAX_BODY_BYTES,
    Unauthorized,
    error_response,
    http_status,
)
from kvstore.server.admin.client import ADDR_FILE, TOKEN_FILE
from kvstore.server.admin.parts import AdminParts, hand_parts
from kvstore.server.admin.routes import ROUTES
from kvstore.server.admin.metrics import OpsMeter, make_registry, total_ops

log = logging.getLogger("kvstore.admin")
OPS_SAMPLE_INTERVAL_S = 1.0
# aiohttp's limit on a request line or header (its default): every query here is far shorter.
MAX_LINE_BYTES = 8190
_request_ids = itertools.count(1)
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


class AdminError(ServiceError):
    """The admin API cannot start (port taken, token file unusable)."""

    code = "admin"


def load_or_create_token(path: str) -> str:
    """The token in `path`, or a new random one written there with mode 0600."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = os.stat(path).st_mode & 0o777
        if mode & 0o077:
            raise AdminError(f"{path} is readable by other users (mode {mode:o}); "
                             "run `chmod 600` on it, or delete it to get a new token") from None
        with open(path) as f:
            token = f.read().strip()
        if not token:
            raise AdminError(f"{path} is empty; delete it and restart the daemon to get a new token")
        return token
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _reachable_host(host: str) -> str:
    """The address a local client dials for a server bound to `host`."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


class AdminServer:
    """One per daemon, constructed as AdminServer(parts) (the parts of the daemon its handlers
    use, server/admin/parts.py) and driven by start() / stop()."""

    def __init__(self, parts: AdminParts):
        self.parts = parts
        self.node, self.host, self.config = parts.node, parts.host, parts.config
        self.token_path = os.path.join(parts.data_dir, TOKEN_FILE)
        self.addr_path = os.path.join(parts.data_dir, ADDR_FILE)
        self.url: str | None = None
        self.ops = OpsMeter()
        self.num_errors: Counter[str] = Counter()  # error code -> count, for /metrics
        self.registry = make_registry(parts.node, self)
        self._token = b""
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._sampler: asyncio.Task | None = None

    def ready(self) -> bool:
        """Ready to serve: the daemon sets `ready` False while recovery runs."""
        return bool(self.node.ready)

    def node_stats(self) -> dict:
        """The daemon's stats (its tiers, namespaces, clients): what /v1/stats reshapes."""
        return self.node.stats()

    async def start(self) -> None:
        self._token = load_or_create_token(self.token_path).encode()
        self._runner = web.AppRunner(make_app(self), handle_signals=False)
        await self._runner.setup()
        loop = asyncio.get_running_loop()
        # Our own listener instead of web.TCPSite: each connection gets a _JsonErrorsHandler,
        # so what aiohttp refuses before the app sees it (a request line or header over its
        # 8190-byte limits, a malformed request) is JSON and one log line too.
        server = self._runner.server
        try:
            self._listener = await loop.create_server(
                lambda: _JsonErrorsHandler(server, self, loop=loop, access_log=None, logger=log.getChild("http"),
                                           max_line_size=MAX_LINE_BYTES, max_field_size=MAX_LINE_BYTES),
                self.config.host, self.config.port)
        except OSError as exc:
            await self._runner.cleanup()
            self._runner = None
            raise AdminError(
                f"admin API cannot listen on {self.config.host}:{self.config.port} ({exc.strerror or exc}); "
                "set admin.port in the config or --admin-port (0 picks a free port), or admin.enabled = false"
            ) from None
        host, port = self._listener.sockets[0].getsockname()[:2]
        self.url = f"http://{_reachable_host(host)}:{port}"
        _write_atomic(self.addr_path, self.url + "\n")
        self._sampler = asyncio.create_task(self._sample_ops())
        log.info("event=admin_ready url=%s", self.url)

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        try:  # leave the file alone if a newer daemon has taken this data dir over
            with open(self.addr_path) as f:
                if f.read().strip() == self.url:
                    os.unlink(self.addr_path)
        except OSError:
            pass

    async def _sample_ops(self) -> None:
        while True:
            self.ops.sample(time.monotonic(), total_ops(self.host))
            await asyncio.sleep(OPS_SAMPLE_INTERVAL_S)

    def ops_per_s(self) -> float:
        return self.ops.rate(time.monotonic(), total_ops(self.host))

    def check_token(self, request: web.Request) -> None:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise Unauthorized(f"send `Authorization: Bearer <token>`; the token is in {self.token_path}")
        if not hmac.compare_digest(given.strip().encode("utf-8", "replace"), self._token):
            raise Unauthorized(f"wrong admin token; the current one is in {self.token_path}")


class _JsonErrorsHandler(web.RequestHandler):
    """aiohttp's connection handler, answering the requests it refuses itself (before any
    route or middleware runs) as the API answers every other error: JSON, one log line."""

    def __init__(self, server, admin: AdminServer, **kwargs):
        super().__init__(server, **kwargs)
        self._admin = admin

    def handle_error(self, request, status: int = 500, exc=None, message=None) -> web.StreamResponse:
        if status >= 500 or request.writer.output_size > 0:  # not a client's mistake: aiohttp's way
            return super().handle_error(request, status, exc, message)
        code = HTTP_CODES.get(status, "http_error")
        if isinstance(exc, LineTooLong):
            text = (f"the request line or a header is longer than {MAX_LINE_BYTES} bytes; "
                    "send long inputs (token lists, many ids) in a JSON body")
        else:
            text = (message or getattr(exc, "message", None) or str(exc) or "bad request").splitlines()[0][:200]
        self._admin.num_errors[code] += 1
        log.warning("event=admin_error request_id=- remote=%s status=%d code=%s message=%s",
                    request.remote, status, code, json.dumps(text))
        response = error_response(status, code, text)
        response.force_close()
        return response


@web.middleware
async def _guard(request: web.Request, handler):
    """Auth, request ids, and every error as JSON with one log line."""
    admin: AdminServer = request.app[ADMIN]
    given = request.headers.get("X-Request-Id", "")
    request_id = given if _CLIENT_REQUEST_ID.fullmatch(given) else f"a{next(_request_ids):x}"
    headers = {"X-Request-Id": request_id}
    try:
        if request.path != "/healthz":
            admin.check_token(request)
        response = await handler(request)
    except web.HTTPException as exc:  # raised by aiohttp itself: no route, wrong method, too large
        status, code, message = exc.status, HTTP_CODES.get(exc.status, "http_error"), exc.reason
        if "Allow" in exc.headers:
            headers["Allow"] = exc.headers["Allow"]
    except KVStoreError as exc:
        status, code, message = http_status(exc), exc.code, exc.message
        if status == 401:
            headers["WWW-Authenticate"] = 'Bearer realm="kvstore"'
    except Exception as exc:
        log.exception("event=admin_error request_id=%s method=%s path=%s status=500",
                      request_id, request.method, json.dumps(request.path))
        admin.num_errors["internal"] += 1
        return error_response(500, "internal", f"internal error ({type(exc).__name__}); "
                              f"see the daemon log for request {request_id}", headers)
    else:
        response.headers.update(headers)
        return response
    admin.num_errors[code] += 1
    log.warning("event=admin_error request_id=%s method=%s path=%s status=%d code=%s message=%s",
                request_id, request.method, json.dumps(request.path), status, code, json.dumps(message))
    return error_response(status, code, message, headers)


def make_app(admin: AdminServer) -> web.Application:
    app = web.Application(middlewares=[_guard], client_max_size=MAX_BODY_BYTES)
    app[ADMIN] = admin
    hand_parts(app, admin.parts)
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    return app
