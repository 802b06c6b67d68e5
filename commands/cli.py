"""`kvstore` command line: serve, status, smoke, demo, bench."""

from __future__ import annotations

import argparse
import os
import sys

from kvstore.commands import admin_cli, demo
from kvstore.commands.config_file import load_config
from kvstore.errors import KVStoreError


def cmd_serve(args) -> int:
    from kvstore.server import daemon, logs
    config = load_config(args)
    logs.configure(config.log_level, config.log_format)
    daemon.run(config)
    return 0


def cmd_smoke(args) -> int:
    from kvstore.commands.smoke import run_smoke
    return run_smoke(args.socket, args.chunks)


def _positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    """Every command and flag (tests/kubernetes parses the manifests' daemon args with it)."""
    parser = argparse.ArgumentParser(prog="kvstore", description="tiered KV/state store for LLM inference")
    sub = parser.add_subparsers(dest="cmd", required=True)

    serve = sub.add_parser("serve", help="run the daemon in the foreground (SIGTERM stops it cleanly)")
    serve.add_argument("--config", help="TOML config file (every key optional)")
    serve.add_argument("--socket", help="Unix socket path (default: $KVSTORE_SOCKET if set, else "
                       "$XDG_RUNTIME_DIR/kvstore/kvstore.sock if XDG_RUNTIME_DIR is set, else /tmp/kvstore-<uid>/kvstore.sock)")
    serve.add_argument("--data-dir", help="data directory")
    serve.add_argument("--arena-bytes", help="host arena size per namespace, e.g. 1GiB")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--log-format", choices=["kv", "json"])
    serve.add_argument("--admin-host", help="admin API address (default 127.0.0.1)")
    serve.add_argument("--admin-port", type=int, help="admin API port (0: any free port, see <data-dir>/admin.addr)")
    # Per-node values a shared config file cannot hold (one ConfigMap for every pod of a
    # Kubernetes DaemonSet: the pod's node name and IP come in as $(NODE_NAME), $(POD_IP)).
    serve.add_argument("--node-id", help="cluster.node_id: this node's name among its peers")
    serve.add_argument("--advertise", help="cluster.advertise: the host:port peers dial")
    serve.add_argument("--mooncake-local-hostname",
                       help="remote.mooncake.local_hostname: this node's address as the Mooncake pool reaches it")
    serve.set_defaults(func=cmd_serve)

    admin_cli.register(sub)  # status, objects, evict: through the admin API

    smoke = sub.add_parser("smoke", help="start a daemon (or use --socket) and run a built-in smoke workload")
    smoke.add_argument("--socket", help="use a running daemon instead of starting one")
    smoke.add_argument("--chunks", type=_positive_int, default=16, help="256-token chunks per state kind")
    smoke.set_defaults(func=cmd_smoke)

    demo.register(sub)  # the agent-like workload on the real model
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        status = args.func(args)
        sys.stdout.flush()  # here, not at exit: a reader gone away is then caught below
        return status
    except KVStoreError as exc:
        print(f"kvstore: {exc.message}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return _stdout_closed()


# 128 + SIGPIPE: what a shell reports for a command whose reader went away (`... | head`).
EXIT_BROKEN_PIPE = 141


def _stdout_closed() -> int:
    """The reader of our stdout left (`kvstore objects ls | head`): stop quietly. Python's
    advice (signal docs, "Note on SIGPIPE"): point stdout at devnull, so the flush at exit
    does not raise a second BrokenPipeError."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
