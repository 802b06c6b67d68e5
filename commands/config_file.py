"""The daemon's configuration as the commands read it: the TOML file, then the flags that
override it. `kvstore serve` starts with it; `kvstore status` and friends read the same file
for the data directory (where the admin API's address and token are), as does the Docker
image's health check."""

from __future__ import annotations

import tomllib
from dataclasses import replace

from kvstore.config import ServerConfig, parse_size


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
    host, admin = config.host, config.admin
    if getattr(args, "arena_bytes", None):
        host = replace(host, arena_bytes=parse_size(args.arena_bytes, "--arena-bytes"))
    if getattr(args, "admin_host", None) or getattr(args, "admin_port", None) is not None:
        admin = replace(admin, host=args.admin_host or admin.host,
                        port=admin.port if args.admin_port is None else args.admin_port)
    cluster, remote = config.cluster, config.remote
    if getattr(args, "node_id", None) or getattr(args, "advertise", None):
        cluster = replace(cluster, node_id=args.node_id or cluster.node_id,
                          advertise=args.advertise or cluster.advertise)
    if getattr(args, "mooncake_local_hostname", None):
        remote = replace(remote, mooncake=replace(remote.mooncake, local_hostname=args.mooncake_local_hostname))
    return config.with_overrides(
        socket_path=getattr(args, "socket", None),
        data_dir=getattr(args, "data_dir", None),
        log_level=getattr(args, "log_level", None),
        log_format=getattr(args, "log_format", None),
        host=host,
        admin=admin,
        cluster=cluster,
        remote=remote,
    )
