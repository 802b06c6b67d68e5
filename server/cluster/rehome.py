"""Re-homing: when membership changes, objects held here are copied to their new home nodes.

    membership says {a, b, c}   (after {a, c})
      -> wait rehome_delay_s for the list to settle (a later change restarts the wait)
      -> plan: every object this node holds (host and NVMe), per node that is one of its
         homes now but was not under some member list seen since the last pass
         (kvstore.ownership.new_homes; objects put meanwhile went to the homes of the list
         of their day, so {a,b,c} -> {a,c} -> {a,b,c} still re-homes to b), this node
         excluded
      -> per target: one batched lookup of what it already holds, then the rest is sent,
         a few transfers at a time, each verified by the receiver against its checksum
      -> sends that failed (target down again) are retried after a backoff while the
         target is still a home of the object

A static peer list never changes, but a member marked down that answers again may lack what
it is home to: `on_peer_back` plans for it as for a node that just joined.

A clean stop (SIGTERM) first hands over: the same plan against the member list without
this node, so what it was home to is on its successors before it leaves (bounded by
cluster.handover_s; membership "etcd" only, a static list never drops a node).

Every node that holds a copy does this, so an object whose old home left is re-homed by
whichever node still has it (its other replica, or the node it was put on); the lookup
keeps two holders from both sending what the target already has. Old homes keep their
copies as ordinary cached objects. Runs on the daemon's event loop; the plan (a hash per
object and node) is computed in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass

from kvstore.identity import ObjectId
from kvstore.ownership import home_nodes, new_homes
from kvstore.server.cluster.serving import PeerServing
from kvstore.server.tiering.objects import live_in

log = logging.getLogger("kvstore.rehome")
# Sends started together (they queue on the cluster link's gate).
BATCH = 64
# Failed sends are retried after this, doubling up to RETRY_MAX_S.
RETRY_FIRST_S, RETRY_MAX_S = 2.0, 60.0
# A progress line every this many objects sent.
PROGRESS_EVERY = 1000


@dataclass(slots=True)
class RehomeCounters:
    passes: int = 0
    objects_sent: int = 0
    bytes_sent: int = 0
    already_held: int = 0  # the new home had it (another holder sent it, or it never left)
    failures: int = 0  # sends that failed (retried while the target stays a home)
    gone: int = 0  # planned objects deleted or evicted here before their turn


class Rehomer:
    def __init__(self, link, local, cluster_config):
        """link: the cluster (server.cluster.link.ClusterLink: its peer tier and send gate);
        local: this node's tiers (server/tiering/chain.py: LocalTiers)."""
        self.link = link
        self.host, self.nvme = local.host, local.nvme
        self.replicas = cluster_config.replicas
        self.delay_s = cluster_config.rehome_delay_s
        self.counters = RehomeCounters()
        self._placed: frozenset[str] | None = None  # the member list of the last pass
        self._members: frozenset[str] | None = None  # the latest member list
        # Every list seen since the last pass: an object committed meanwhile went to its
        # homes under one of them, so a node is a new home unless it was a home under all.
        self._seen: set[frozenset[str]] = set()
        self._retry: dict[str, set[tuple[str, bytes]]] = {}  # node -> keys whose send failed
        self._retry_s = RETRY_FIRST_S
        self._task: asyncio.Task | None = None
        self._running = False
        self._stopped = False
        self._last: dict = {}

    # --- triggers -----------------------------------------------------------------------

    def begin(self, members) -> None:
        """The member list at start: what objects here count as placed for."""
        if self._placed is None:
            self._placed = self._members = frozenset(members)

    def on_members(self, members) -> None:
        """Membership's change callback (on the loop). Before `begin`, the first list is the
        baseline."""
        names = frozenset(members)
        if self._placed is None:
            self._placed = self._members = names
            return
        if names == self._members:
            return
        self._members = names
        self._seen.add(names)
        self._schedule(self.delay_s)

    def on_peer_back(self, node: str) -> None:
        """A member of a static peer list answers again after it was marked down. The list
        never changed, yet the node may lack what it is home to (puts that fell back while
        it was down, demotions that failed, its memory if it restarted): the next pass plans
        as if it had just joined (the list without it was seen), so it gets what it lacks."""
        if self._members is None or node not in self._members:
            return
        self._seen.add(self._members - {node})
        self._schedule(self.delay_s)

    def _schedule(self, delay_s: float) -> None:
        if self._running or self._stopped:
            return  # the pass in progress looks at the latest list again when it ends
        if self._task is not None:
            self._task.cancel()  # a change during the wait restarts it
        self._task = asyncio.get_running_loop().create_task(self._after(delay_s))

    async def _after(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self._running = True
        try:
            await self.run_pass()
        except Exception:
            log.exception("event=rehome_failed")
        finally:
            self._running = False
        self._task = None  # this task is ending: the next one must not cancel it
        if self._members != self._placed or self._seen:  # changes during the pass
            self._schedule(self.delay_s)
        elif self._retry:
            self._schedule(self._retry_s)
            self._retry_s = min(2 * self._retry_s, RETRY_MAX_S)
        else:
            self._retry_s = RETRY_FIRST_S

    def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()

    # --- one pass ---------------------------------------------------------------------------

    async def run_pass(self) -> dict:
        """Copy what this node holds to the nodes that became its homes since the last pass,
        and retry earlier failures. Returns what it did (also kept for stats)."""
        before, after = self._placed, self._members
        if self.link.remote is None or before is None or after is None:
            return {}
        seen, self._seen = self._seen | {before}, set()
        self._placed = after
        retry, self._retry = self._retry, {}
        return await self._execute("rehome", seen, after, retry)

    async def hand_over(self, timeout_s: float) -> dict:
        """On a clean stop, before leaving membership: copy what this node holds to the
        nodes that are its homes once this node is gone (what it was home to, mostly), for
        at most `timeout_s`. Stops the re-homing passes."""
        self.stop()
        remote = self.link.remote
        members = frozenset(remote.members()) if remote is not None else frozenset()
        after = members - {remote.node_id} if remote is not None else frozenset()
        if not after:
            return {}
        try:
            async with asyncio.timeout(timeout_s):
                return await self._execute("handover", {members}, after, {})
        except TimeoutError:
            log.warning("event=handover_incomplete timeout_s=%g sent=%d", timeout_s, self.counters.objects_sent)
            return {}

    async def _execute(self, event: str, seen, after, retry) -> dict:
        start = time.monotonic()
        self.counters.passes += 1
        me = self.link.remote.node_id
        plan = await asyncio.to_thread(self._plan, self._held_here(), seen, after)
        for node, keys in retry.items():
            if node in after and node != me:
                mine = [k for k in keys if node in home_nodes(k[1], after, self.replicas)]
                plan.setdefault(node, set()).update(mine)
        total = sum(len(keys) for keys in plan.values())
        if total:
            log.info("event=%s_start members=%s was=%s objects=%d targets=%s", event, ",".join(sorted(after)),
                     "|".join(",".join(sorted(m)) for m in seen if m != after) or "-", total,
                     ",".join(f"{n}:{len(k)}" for n, k in sorted(plan.items())))
        before_counts = asdict(self.counters)
        for node, keys in sorted(plan.items()):
            await self._send_to(node, sorted(keys))
        done = {k: v - before_counts[k] for k, v in asdict(self.counters).items() if k != "passes"}
        self._last = {"kind": event, "members": sorted(after), "planned": total,
                      "seconds": round(time.monotonic() - start, 3), **done}
        if total:
            log.info("event=%s_done planned=%d sent=%d bytes=%d already_held=%d failed=%d gone=%d seconds=%.2f",
                     event, total, done["objects_sent"], done["bytes_sent"], done["already_held"], done["failures"],
                     done["gone"], self._last["seconds"])
        return self._last

    def _held_here(self) -> dict[str, list[ObjectId]]:
        """Every live object of this node by namespace: host entries and NVMe-only ones."""
        now = self.host.clock()
        held: dict[str, set] = {}
        for name, ns in self.host.namespaces.items():
            held[name] = {oid.digest for oid, e in ns.objects.items() if e.is_live(now)}
        for namespace, digest in self.nvme.keys():
            held.setdefault(namespace, set()).add(digest)
        return {name: [ObjectId(d) for d in digests] for name, digests in held.items() if digests}

    def _plan(self, held, seen, after) -> dict[str, set[tuple[str, bytes]]]:
        me = self.link.remote.node_id
        plan: dict[str, set] = {}
        for namespace, oids in held.items():
            for before in seen:
                for node, moved in new_homes(oids, before, after, self.replicas).items():
                    if node != me:
                        plan.setdefault(node, set()).update((namespace, oid.digest) for oid in moved)
        return plan

    async def _send_to(self, node: str, keys: list[tuple[str, bytes]]) -> None:
        remote = self.link.remote
        by_ns: dict[str, list[ObjectId]] = {}
        for namespace, digest in keys:
            by_ns.setdefault(namespace, []).append(ObjectId(digest))
        todo = []
        for namespace, oids in by_ns.items():
            has = await remote.held_on(node, namespace, oids)
            if has is None:  # the target cannot be asked: keep all for the retry
                self._fail(node, [(namespace, oid.digest) for oid in oids])
                continue
            self.counters.already_held += sum(has)
            todo += [(namespace, oid) for oid, h in zip(oids, has) if not h]
        # The link's gate (shared with commit copies and demotions) bounds the sends in
        # flight; batches bound the tasks waiting for it.
        for start in range(0, len(todo), BATCH):
            await asyncio.gather(*(self._send_one(node, ns, oid) for ns, oid in todo[start:start + BATCH]))

    async def _send_one(self, node: str, namespace: str, oid: ObjectId) -> None:
        try:
            async with self.link.sending(namespace, oid):
                sent = await self._copy_to(node, namespace, oid)
        except Exception as exc:  # one object's trouble (EIO on NVMe, say) is its own
            log.warning("event=rehome_send_failed node=%s id=%s error=%r", node, oid, exc)
            sent = False
        if sent is None:
            self.counters.gone += 1
            return
        if not sent:
            self._fail(node, [(namespace, oid.digest)])
            return
        self.counters.objects_sent += 1
        self.counters.bytes_sent += sent
        if self.counters.objects_sent % PROGRESS_EVERY == 0:
            log.info("event=rehome_progress sent=%d bytes=%d", self.counters.objects_sent, self.counters.bytes_sent)

    async def _copy_to(self, node: str, namespace: str, oid: ObjectId) -> int | bool | None:
        """Bytes sent (the object's size), False when the send failed, None when it is gone."""
        remote = self.link.remote
        entry = live_in(self.host.namespaces.get(namespace), oid, self.host.clock())
        if entry is not None:
            with self.host.held_view(entry) as view:
                ok = await remote.put_to(node, namespace, oid, PeerServing.meta(entry), view)
            return ok and entry.size
        if self.nvme.holds(namespace, oid):
            copy = await self.nvme.read_copy(namespace, oid)
            if copy is None:
                return None
            meta, data = copy
            return await remote.put_to(node, namespace, oid, meta, data) and meta.size
        return None

    def _fail(self, node: str, keys) -> None:
        self.counters.failures += len(keys)
        self._retry.setdefault(node, set()).update(keys)

    def stats(self) -> dict:
        return {**asdict(self.counters), "running": self._running,
                "pending_retries": sum(len(k) for k in self._retry.values()), "last_pass": dict(self._last)}
