"""Prometheus metrics and the ops-per-second meter, both read from the tier manager's counters.

Nothing is counted twice: the collector turns `Daemon.stats()` into metric families at
scrape time, so it keeps no state and needs no global registry (each admin server owns
its own `CollectorRegistry`). Called on the event loop thread, like every admin handler.
"""

from __future__ import annotations

from collections import deque

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# manager.stats() counter -> (metric name without _total, help)
COUNTERS = {
    "num_puts": ("kvstore_puts", "Objects committed"),
    "num_dedup_puts": ("kvstore_dedup_puts", "Puts of an id already stored (nothing copied)"),
    "num_gets": ("kvstore_gets", "Get requests (reads)"),
    "num_hits": ("kvstore_hits", "Gets that found the object"),
    "num_shared_hits": ("kvstore_shared_hits", "Hits clients read from the shared index (in kvstore_hits too)"),
    "num_misses": ("kvstore_misses", "Gets that did not find the object"),
    "num_evictions": ("kvstore_evictions", "Objects evicted to make room or by an operator"),
    "num_expired": ("kvstore_expired", "Objects dropped when their ttl passed"),
    "num_deletes": ("kvstore_deletes", "Objects deleted on request"),
    "num_group_puts": ("kvstore_group_puts", "Store groups committed (their objects count as puts too)"),
    "num_checksum_failures": ("kvstore_checksum_failures", "Puts refused because their bytes failed the checksum"),
    "bytes_in": ("kvstore_bytes_in", "Bytes committed by puts"),
    "bytes_out": ("kvstore_bytes_out", "Bytes handed out by gets"),
}
GAUGES = {
    "objects": ("kvstore_objects", "Objects stored"),
    "used_bytes": ("kvstore_used_bytes", "Bytes allocated in the tier (objects, leases, puts in flight)"),
    "capacity_bytes": ("kvstore_capacity_bytes", "Bytes the tier may hold"),
    "slab_free_bytes": ("kvstore_slab_free_bytes", "Free slots in host arena slabs (for their size class only)"),
    "pinned": ("kvstore_pinned_objects", "Objects pinned resident"),
}
# Movement between host and NVMe (server/tiering/nvme_mover.py), node-wide.
NVME_COUNTERS = {
    "num_demotions": ("kvstore_nvme_demotions", "Objects written to NVMe when the host tier evicted them"),
    "num_promotions": ("kvstore_nvme_promotions", "Objects read back from NVMe into the host tier (verified)"),
    "num_rejected": ("kvstore_nvme_admission_rejections", "Host victims the NVMe admission filter turned away"),
    "num_nvme_evictions": ("kvstore_nvme_evictions", "Objects the full NVMe tier dropped to make room"),
    "num_demotion_failures": ("kvstore_nvme_write_failures", "Writes to NVMe that failed (disk error, full, checksum)"),
}
# The cluster (server/cluster/link.py, tiers/remote/, server/cluster/rehome.py), node-wide:
# (section of stats()["tiers"]["remote"] or None for its top level, key) -> (name, help).
CLUSTER_COUNTERS = {
    ("remote", "num_gets"): ("kvstore_remote_gets", "Local misses asked of home nodes"),
    ("remote", "num_ranged_gets"): ("kvstore_remote_ranged_gets", "Remote gets of byte ranges only (sparse readers)"),
    ("remote", "num_hits"): ("kvstore_remote_hits", "Remote gets that brought verified bytes"),
    ("remote", "num_misses"): ("kvstore_remote_misses", "Remote gets no home could serve"),
    ("remote", "num_peer_failures"): ("kvstore_peer_failures", "Peer calls that timed out, broke or were refused"),
    ("remote", "num_peer_skips"): ("kvstore_peer_skips", "Peer calls not tried: the peer failed moments ago"),
    ("remote", "num_checksum_failures"): ("kvstore_remote_checksum_failures", "Remote bytes refused by their checksum"),
    ("remote", "bytes_in"): ("kvstore_remote_bytes_in", "Bytes fetched from peers"),
    ("remote", "bytes_out"): ("kvstore_remote_bytes_out", "Bytes stored on peers"),
    (None, "num_replicated"): ("kvstore_remote_replicated", "Commits copied to every remote home"),
    (None, "num_demoted_remote"): ("kvstore_remote_demotions", "Objects sent to their homes as they left this node"),
    (None, "num_demotion_failures"): ("kvstore_remote_demotion_failures", "Demotions no home took"),
    (None, "num_remote_puts"): ("kvstore_remote_puts", 'Puts with tier="remote"'),
    (None, "num_remote_put_fallbacks"): ("kvstore_remote_put_fallbacks", 'tier="remote" puts kept here: no home took them'),
    ("rehome", "passes"): ("kvstore_rehome_passes", "Re-homing passes (and handovers) run"),
    ("rehome", "objects_sent"): ("kvstore_rehome_objects", "Objects copied to their new homes"),
    ("rehome", "bytes_sent"): ("kvstore_rehome_bytes", "Bytes copied to new homes"),
    ("rehome", "failures"): ("kvstore_rehome_failures", "Re-homing sends that failed (retried)"),
}
# The KV event stream for routers (server/events/), node-wide, when [events] enabled.
EVENTS_COUNTERS = {
    "num_batches": ("kvstore_events_batches", "Event batches numbered and kept for replay (all namespaces)"),
    "num_events": ("kvstore_events", "Holdings changes published (stored, removed, cleared)"),
    "num_sent_batches": ("kvstore_events_sent_batches", "Batches the publisher thread sent on the PUB socket"),
    "num_dropped_batches": ("kvstore_events_dropped_batches",
                            "Batches not sent live (publisher queue full); subscribers get them by replay"),
    "num_replays": ("kvstore_events_replays", "Replay requests answered"),
    "num_bad_replay_requests": ("kvstore_events_bad_replay_requests", "Replay requests of neither form, ignored"),
    "num_snapshot_requests": ("kvstore_events_snapshot_requests", "Snapshot requests received"),
    "num_snapshots": ("kvstore_events_snapshots", "Snapshots sent whole (end marker included)"),
    "num_refused_snapshots": ("kvstore_events_refused_snapshots",
                              "Snapshot requests refused (too many waiting); the router asks again"),
    "num_heartbeats": ("kvstore_events_heartbeats", "Heartbeats sent (empty batches repeating a number)"),
    "num_kept_objects": ("kvstore_events_kept_objects", "Objects NVMe kept over a restart, added to the holdings"),
}
# Puts (stored or deduplicated), gets and deletes count as operations for the ops/s meter.
OPS_COUNTERS = ("num_puts", "num_dedup_puts", "num_gets", "num_deletes")


def total_ops(host) -> int:
    return sum(getattr(ns.counters, name) for ns in host.namespaces.values() for name in OPS_COUNTERS)


class OpsMeter:
    """Operations per second over the last `window` samples (one sample a second)."""

    def __init__(self, window: int = 10):
        self._samples: deque[tuple[float, int]] = deque(maxlen=window + 1)

    def sample(self, now: float, ops: int) -> None:
        self._samples.append((now, ops))

    def rate(self, now: float, ops: int) -> float:
        if not self._samples:
            return 0.0
        then, before = self._samples[0]
        return max(0, ops - before) / (now - then) if now > then else 0.0


class StatsCollector:
    """A prometheus-client collector over one daemon's stats (and its admin server's error counts)."""

    def __init__(self, node, admin):
        self.node = node
        self.admin = admin

    def collect(self):
        stats = self.node.stats()
        labels = ["namespace", "tier"]
        families = {}
        for key, (name, doc) in COUNTERS.items():
            families[key] = CounterMetricFamily(name, doc, labels=labels)
        for key, (name, doc) in GAUGES.items():
            families[key] = GaugeMetricFamily(name, doc, labels=labels)
        for ns_name, ns in sorted(stats["namespaces"].items()):
            for key, family in families.items():
                family.add_metric([ns_name, "host"], ns.get(key, 0))
        nvme = stats.get("tiers", {}).get("nvme")
        if nvme is not None:  # node-wide: one series with namespace "*"
            for key, family in families.items():
                if key in nvme:
                    family.add_metric(["*", "nvme"], nvme[key])
        yield from families.values()
        if nvme is not None:
            for key, (name, doc) in NVME_COUNTERS.items():
                yield CounterMetricFamily(name, doc, value=nvme.get(key, 0))
        events = stats.get("events")
        if events is not None:
            for key, (name, doc) in EVENTS_COUNTERS.items():
                yield CounterMetricFamily(name, doc, value=events.get(key, 0))
            yield GaugeMetricFamily("kvstore_events_held_objects",
                                    "Objects the event stream has published as held (all namespaces and media)",
                                    value=events.get("held_objects", 0))
        remote = stats.get("tiers", {}).get("remote")
        if remote is not None:  # a clustered node
            yield from _cluster_families(remote)
        for name, doc, value in (
            ("kvstore_leases", "Leases held by clients", stats["leases"]),
            ("kvstore_clients", "Local clients connected", stats["clients"]),
            ("kvstore_uptime_seconds", "Seconds since the daemon started", stats["uptime_s"]),
            ("kvstore_ready", "1 once the daemon serves requests", 1 if self.admin.ready() else 0),
            ("kvstore_host_bandwidth_bytes_per_second", "Measured host copy bandwidth (load-time estimates)",
             stats["host_bandwidth_bytes_s"]),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        errors = CounterMetricFamily("kvstore_admin_errors", "Admin API requests answered with an error",
                                     labels=["code"])
        for code, count in sorted(self.admin.num_errors.items()):
            errors.add_metric([code], count)
        yield errors


def _cluster_families(cluster: dict):
    for (section, key), (name, doc) in CLUSTER_COUNTERS.items():
        values = cluster if section is None else cluster.get(section) or {}
        if key in values:
            yield CounterMetricFamily(name, doc, value=values[key])
    auth = CounterMetricFamily("kvstore_peer_auth_failures", "Peer handshakes refused for a wrong cluster secret "
                               "(client: links this node opened; server: links it accepted)", labels=["side"])
    for side, count in sorted((cluster.get("auth_failures") or {}).items()):
        auth.add_metric([side], count)
    yield auth
    down = set(cluster.get("remote", {}).get("peers_down", ()))
    members = GaugeMetricFamily("kvstore_cluster_member_up", "Members this node sees: 0 while a call to it "
                                "failed within the peer timeout", labels=["node"])
    for node in sorted(cluster.get("members", {})):
        members.add_metric([node], 0 if node in down else 1)
    yield members
    rehome = cluster.get("rehome") or {}
    if rehome:
        yield GaugeMetricFamily("kvstore_rehome_pending_retries", "Re-homing sends waiting for a retry",
                                value=rehome.get("pending_retries", 0))


def make_registry(node, admin) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(node, admin))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
