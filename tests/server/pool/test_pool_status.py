"""The pool as operators see it: /v1/cluster's `pool` and `kvstore status`'s remote line, from
a real daemon on a real mooncake_master (its /metrics page read for what the pool holds)."""

from kvstore.commands.cli import main
from kvstore.pool_header import HEADER_BYTES
from kvstore.server.admin.client import AdminClient
from kvs_testing import wait_for
from mooncake_helpers import oids, pool_config, pool_stats, pool_up, put_into_pool

SIZE = 60_000


def status_line(daemon, capsys) -> str:
    assert main(["status", "--data-dir", daemon.data_dir]) == 0
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("remote tier: "))


def test_cluster_and_status_show_the_pool_and_what_it_holds(master, keeper, daemon_factory, capsys):
    url = f"http://127.0.0.1:{master.metrics_port}/metrics"
    a = daemon_factory("32MiB", config=pool_config(master, master_metrics_url=url, tenant_id="team-a"))
    keys = oids(100, 4)
    with a.client() as ca:
        pool_up(ca)
        put_into_pool(ca, keys, [SIZE] * 4)
        assert ca.delete(keys[:1], scope="node") == 1 and ca.get(keys[0]) is not None  # one hit from the pool
    api = AdminClient.from_data_dir(a.data_dir)
    pool = api.get("/v1/cluster")["pool"]
    assert (pool["backend"], pool["master"], pool["up"], pool["last_error"]) == ("mooncake", master.address, True, None)
    assert (pool["tenant_id"], pool["replicas"], pool["remote_write"]) == ("team-a", 1, "write_through")
    assert pool["write_through_backlog"] == 0  # every copy went (put_into_pool waited for them)
    assert pool["held"]["keys"] == 4 and pool["held_error"] is None  # the keeper holds nothing else
    assert pool["held"]["allocated_bytes"] >= 4 * (HEADER_BYTES + SIZE)
    assert pool["held"]["capacity_bytes"] >= pool["held"]["allocated_bytes"] > 0
    assert pool["counters"]["num_replicated"] == 4 and pool["counters"]["num_hits"] == 1
    line = status_line(a, capsys)
    assert f"mooncake pool, master {master.address} up; holds " in line and "in 4 keys" in line, line
    assert "1 hits" in line and "0 failed checks" in line and "4 put" in line, line

    master.kill()
    with a.client() as ca:  # the next call to the pool finds the master gone
        assert ca.delete(keys[1:2], scope="node") == 1 and ca.get(keys[1]) is None
        assert wait_for(lambda: pool_stats(ca)["pool"]["up"] is False, timeout=30)
    pool = api.get("/v1/cluster")["pool"]
    assert pool["up"] is False and pool["last_error"] and pool["held"] is None
    assert "unreachable" in pool["held_error"]
    assert "DOWN (" in status_line(a, capsys)


def test_without_a_metrics_url_the_pool_is_shown_and_its_holdings_are_not(master, keeper, daemon_factory):
    a = daemon_factory("32MiB", config=pool_config(master))
    with a.client() as ca:
        pool_up(ca)
    doc = AdminClient.from_data_dir(a.data_dir).get("/v1/cluster")
    assert doc["pool"]["up"] is True and doc["pool"]["held"] is None
    assert "master_metrics_url" in doc["pool"]["held_error"] and "members" not in doc
