"""Fixtures that start real daemons. Sockets live under a short /tmp dir (sun_path is ~108 bytes)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile

import pytest

from kvstore.commands.smoke import start_daemon


class DaemonProcess:
    def __init__(self, root: str, config: dict | None = None):
        self.root = root
        self.socket = os.path.join(root, "kvstore.sock")
        self.data_dir = os.path.join(root, "data")
        self.config_path = os.path.join(root, "kvstore.toml")
        config = dict(config or {})
        config["data_dir"] = self.data_dir
        config["admin"] = {"port": 0, **config.get("admin", {})}
        with open(self.config_path, "w") as f:
            f.write(_config_text(config))
        self.proc = None

    def start(self, arena_bytes: str = "16MiB"):
        self.proc = start_daemon(self.socket, arena_bytes, extra=["--config", self.config_path])
        return self

    def client(self, **kwargs):
        from kvstore.client import Client
        return Client.connect(self.socket, **kwargs)

    def stop(self, sig=signal.SIGTERM, timeout=20) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout)
        return None if self.proc is None else self.proc.returncode


def _toml_value(value) -> str:
    return json.dumps(value)  # JSON scalars are valid TOML for str, int, float and bool


def _config_text(config: dict, prefix: str = "") -> str:
    """Render {key: scalar, section: {key: scalar, subsection: {...}}} as TOML; a table's
    scalars come before its subtables."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in config.items() if not isinstance(v, dict)]
    for name, table in config.items():
        if isinstance(table, dict):
            lines += [f"[{prefix}{name}]", _config_text(table, f"{prefix}{name}.").rstrip("\n")]
    return "\n".join(line for line in lines if line) + "\n"


def _daemons():
    """make(arena_bytes, config) -> a started DaemonProcess; each is stopped after."""
    made = []

    def make(arena_bytes: str = "16MiB", config: dict | None = None) -> DaemonProcess:
        d = DaemonProcess(tempfile.mkdtemp(prefix="kvs-"), config)
        made.append(d)
        return d.start(arena_bytes)

    yield make
    for d in made:
        try:
            d.stop(signal.SIGKILL if d.proc and d.proc.poll() is None else signal.SIGTERM)
        finally:
            shutil.rmtree(d.root, ignore_errors=True)


@pytest.fixture
def daemon_factory():
    yield from _daemons()


@pytest.fixture(scope="module")
def module_daemon_factory():
    """daemon_factory for daemons a whole module's tests share."""
    yield from _daemons()


@pytest.fixture
def unstarted_daemon():
    """make(config) -> a DaemonProcess whose config file is written but which is not started
    (tests of start-up run `kvstore serve --config d.config_path` themselves)."""
    made = []

    def make(config: dict | None = None) -> DaemonProcess:
        made.append(DaemonProcess(tempfile.mkdtemp(prefix="kvs-"), config))
        return made[-1]

    yield make
    for d in made:
        shutil.rmtree(d.root, ignore_errors=True)


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    return daemon_factory()


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for the module: two spinning OpenMP threads on 2 shared cores
    run the reference engine 3-5x slower. torch is imported only by modules that use this."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
