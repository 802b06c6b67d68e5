"""kvstore pins in the Mooncake pool: an object put with hints.pin is soft-pinned there, as
the master itself counts (its /metrics soft-pin gauge, through /v1/cluster)."""

import numpy as np

from kvstore.hints import Hints
from kvstore.server.admin.client import AdminClient
from kvs_testing import payload, wait_for
from mooncake_helpers import oids, pool_config, pool_stats, pool_up


def test_objects_put_with_a_pin_are_soft_pinned_in_the_pool(master, keeper, daemon_factory):
    url = f"http://127.0.0.1:{master.metrics_port}/metrics"
    a = daemon_factory("32MiB", config=pool_config(master, master_metrics_url=url))
    c = daemon_factory("32MiB", config=pool_config(master))
    pinned, plain = oids(120, 2), oids(130, 3)
    with a.client() as ca, c.client() as cc:
        pool_up(ca, cc)
        for i, key in enumerate(pinned + plain):
            ca.put(key, payload(40_000, i), hints=Hints(pin=key in pinned))
        assert wait_for(lambda: pool_stats(ca)["num_replicated"] == 5)
        for i, key in enumerate(pinned + plain):  # read back on another node: the header kept the hints
            out = np.empty(40_000, np.uint8)
            assert cc.get_into(key, out) == 40_000 and np.array_equal(out, payload(40_000, i))
    held = AdminClient.from_data_dir(a.data_dir).get("/v1/cluster")["pool"]["held"]
    assert (held["keys"], held["soft_pinned_keys"]) == (5, 2)
