#!/opt/kvstore/bin/python3
"""The image's HEALTHCHECK: exit 0 once the daemon's admin API answers GET /readyz with 200.

It finds the daemon as `kvstore status --config FILE` does: data_dir from the config file
(argument 1, default /etc/kvstore/kvstore.toml), then the URL in <data_dir>/admin.addr and
the bearer token in <data_dir>/admin.token. The admin API listens on 127.0.0.1 inside the
container, which is where Docker runs this.
"""

import argparse
import sys

from kvstore.errors import KVStoreError
from kvstore.server.admin.client import AdminClient
from kvstore.commands.config_file import load_config

TIMEOUT_S = 4.0  # below the HEALTHCHECK --timeout


def main() -> int:
    config = sys.argv[1] if len(sys.argv) > 1 else "/etc/kvstore/kvstore.toml"
    data_dir = load_config(argparse.Namespace(config=config)).data_dir
    try:
        admin = AdminClient.from_data_dir(data_dir)
        admin.timeout_s = TIMEOUT_S
        print(admin.get("/readyz"))
    except KVStoreError as exc:  # not ready (503), not started yet, or not answering
        print(f"not ready: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
