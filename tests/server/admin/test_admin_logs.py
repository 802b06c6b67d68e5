"""Admin errors log one structured line each, with the request id; successes log nothing."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile

import aiohttp

from kvstore.config import AdminConfig, ServerConfig
from kvstore.server.daemon import Daemon
from kvstore.server.logs import _KeyValueFormatter


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.setFormatter(_KeyValueFormatter())
        self.lines: list[str] = []
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.lines.append(self.format(record))


async def _scenario(config: ServerConfig) -> dict:
    daemon = Daemon(config)
    await daemon.start()
    try:
        url = daemon.admin.url
        with open(os.path.join(config.data_dir, "admin.token")) as f:
            auth = {"Authorization": f"Bearer {f.read().strip()}"}
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/v1/stats", headers=auth) as ok:
                assert ok.status == 200
            async with session.get(url + "/v1/stats", headers={"X-Request-Id": "req-42"}) as denied:
                assert denied.status == 401 and denied.headers["X-Request-Id"] == "req-42"
            async with session.get(url + "/v1/objects/xyz", headers=auth) as bad:
                assert bad.status == 400
                return {"bad_id": bad.headers["X-Request-Id"]}
    finally:
        await daemon.stop()


def _run_logged(tmp_path, scenario):
    """Run `scenario(config)` against an in-process daemon; (its result, the admin log lines)."""
    sock_dir = tempfile.mkdtemp(prefix="kvs")
    config = ServerConfig(data_dir=str(tmp_path), socket_path=os.path.join(sock_dir, "s"),
                          admin=AdminConfig(port=0))
    handler, logger = _Lines(), logging.getLogger("kvstore.admin")
    logger.addHandler(handler)
    old_level, logger.level = logger.level, logging.INFO
    try:
        return asyncio.run(scenario(config)), handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        shutil.rmtree(sock_dir)  # the socket is gone; its lock file (<socket>.lock) stays, as it should


def test_one_line_per_admin_error(tmp_path):
    ids, handler = _run_logged(tmp_path, _scenario)
    errors = [line for line in handler.lines if "event=admin_error" in line]
    assert len(errors) == 2, handler.lines
    assert all("\n" not in line for line in errors)
    assert "request_id=req-42" in errors[0] and "status=401" in errors[0] and "code=unauthorized" in errors[0]
    assert f"request_id={ids['bad_id']}" in errors[1] and "status=400" in errors[1]
    assert not any("/v1/stats" in line and "status=200" in line for line in handler.lines)


async def _long_lines(config: ServerConfig) -> list[int]:
    daemon = Daemon(config)
    await daemon.start()
    try:
        statuses = []
        async with aiohttp.ClientSession() as session:
            for path, headers in [("/v1/objects?model=" + "a" * 9000, {}), ("/healthz", {"X-Big": "b" * 9000})]:
                async with session.get(daemon.admin.url + path, headers=headers) as resp:
                    assert resp.content_type == "application/json"
                    statuses.append(resp.status)
        return statuses
    finally:
        await daemon.stop()


def test_a_request_line_over_the_limit_logs_one_line_and_no_traceback(tmp_path):
    """aiohttp refused it before our middleware ran and logged a stack trace."""
    statuses, handler = _run_logged(tmp_path, _long_lines)
    assert statuses == [400, 400]
    errors = [line for line in handler.lines if "event=admin_error" in line]
    assert len(errors) == 2 and all("status=400" in line and "\n" not in line for line in errors), handler.lines
    assert not [r for r in handler.records if r.exc_info], handler.lines
