"""`kvstore` command line: serve, status, smoke, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib

from kvstore.config import ServerConfig, parse_size
from kvstore.errors import KVStoreError


def load_config(args) -> ServerConfig:
    data = {}
    if getattr(args, "config", None):
        try:
            with open(args.config, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise SystemExit(f"kvstore: cannot read config {args.config}: {exc.strerror}")
        except tomllib.TOMLDecodeError as exc:
            raise SystemExit(f"kvstore: {args.config} is not valid TOML: {exc}")
    config = ServerConfig.from_dict(data)
    host = config.host
    if getattr(args, "arena_bytes", None):
        from dataclasses import replace
        host = replace(host, arena_bytes=parse_size(args.arena_bytes))
    return config.with_overrides(
        socket_path=getattr(args, "socket", None),
        data_dir=getattr(args, "data_dir", None),
        log_level=getattr(args, "log_level", None),
        log_format=getattr(args, "log_format", None),
        host=host,
    )


def cmd_serve(args) -> int:
    from server import daemon, logs
    config = load_config(args)
    logs.configure(config.log_level, config.log_format)
    daemon.run(config)
    return 0


def _bar(used: int, total: int, width: int = 20) -> str:
    filled = int(width * used / total) if total else 0
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def cmd_status(args) -> int:
    from client import Client
    with Client.connect(args.socket) as client:
        stats = client.stats()
    if args.json:
        print(json.dumps(stats, indent=2, default=str))
        return 0
    print(f"kvstore {stats['version']}  pid {stats['pid']}  up {stats['uptime_s']:.0f} s  "
          f"clients {stats['clients']}  leases {stats['leases']}  socket {stats['socket']}")
    print(f"{'namespace':<16} {'tier':<5} {'objects':>8} {'used':>10} {'capacity':>10} {'':22} {'hit rate':>8} {'evictions':>9}")
    for name, ns in sorted(stats["namespaces"].items()):
        lookups = ns["num_hits"] + ns["num_misses"]
        rate = f"{100 * ns['num_hits'] / lookups:.0f}%" if lookups else "-"
        print(f"{name:<16} {'host':<5} {ns['objects']:>8} {_human(ns['used_bytes']):>10} "
              f"{_human(ns['capacity_bytes']):>10} {_bar(ns['used_bytes'], ns['capacity_bytes']):22} "
              f"{rate:>8} {ns['num_evictions']:>9}")
    if not stats["namespaces"]:
        print("(no namespaces opened yet)")
    return 0


def cmd_smoke(args) -> int:
    from server.smoke import run_smoke
    return run_smoke(args.socket, args.chunks)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore", description="tiered KV/state store for LLM inference")
    sub = parser.add_subparsers(dest="cmd", required=True)

    serve = sub.add_parser("serve", help="run the daemon in the foreground (SIGTERM stops it cleanly)")
    serve.add_argument("--config", help="TOML config file (every key optional)")
    serve.add_argument("--socket", help="Unix socket path (default: $KVSTORE_SOCKET or /tmp/kvstore-<uid>/kvstore.sock)")
    serve.add_argument("--data-dir", help="data directory")
    serve.add_argument("--arena-bytes", help="host arena size per namespace, e.g. 1GiB")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--log-format", choices=["kv", "json"])
    serve.set_defaults(func=cmd_serve)

    status = sub.add_parser("status", help="what the daemon holds")
    status.add_argument("--socket")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

    smoke = sub.add_parser("smoke", help="start a daemon (or use --socket) and run a built-in smoke workload")
    smoke.add_argument("--socket", help="use a running daemon instead of starting one")
    smoke.add_argument("--chunks", type=int, default=16, help="256-token chunks per state kind")
    smoke.set_defaults(func=cmd_smoke)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KVStoreError as exc:
        print(f"kvstore: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
