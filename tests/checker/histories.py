"""The history checker: what every read, miss and lookup of a concurrent run must be explainable by.

A run (tests/checker/run.py) records every operation each worker made: what it asked, when it
started and ended (CLOCK_MONOTONIC, one clock for every process of the machine), and what it
got. Each put writes a version of a key that no other put writes (tests/checker/values.py),
and each read decodes which version it got, so a read names the one put it can come from.
The rules, each an anomaly when broken:

    foreign      a read returned bytes that are not a whole version of that key in that
                 namespace (another key's, another namespace's, torn, or garbage)
    phantom      a read returned a version no put of that key had begun by the read's end
    resurrected  every put of the version read was followed by an acknowledged delete that
                 ended before the read began (a deleted id never reappears unless put again)
    expired      every put of the version read had a TTL that ran out before the read began
    lost         (where the run's store promises it) an acknowledged put, not deleted since,
                 not given a TTL, was a miss: NVMe write_through (ample NVMe) promises it across
                 SIGKILL for puts acknowledged durable; NVMe write_back across clean stops only
    torn group   a group read returned members of different group puts

Puts whose outcome is unknown (the call was cancelled, interrupted, or its process killed or
its daemon lost mid-way) may or may not have been applied: they explain reads from their
start on and are never counted dead, but promise nothing. An operator's delete that was not
acknowledged likewise may have been applied (it excuses misses) but kills nothing.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field

# A TTL is judged from the put's end; the daemon starts it within the put (never later), and
# host and client read the same CLOCK_MONOTONIC. Kept for clocks read a little apart.
TTL_MARGIN_S = 0.05
UNKNOWN = "unknown"  # the outcome of a call that did not finish
# The outcome of a put that stored its version. "existed" does not: the id was held already
# (ids name one state: a put of the same id is not copied again, whatever its bytes), and a
# put of the same version again ("put_again") is explained by the put that stored it.
STORED = ("ok",)


@dataclass
class Put:
    worker: str
    ns: int
    key: int
    version: int
    t0: float
    t1: float = math.inf  # inf: not known to have ended (unknown outcome)
    outcome: str = UNKNOWN  # ok, existed, conflict, error:<code>, unknown
    durability: str | None = None  # the put's reply: sync, group, memory
    ttl_s: float | None = None

    def may_be_stored(self) -> bool:
        return self.outcome in STORED or self.outcome == UNKNOWN


@dataclass
class Delete:
    ns: int
    key: int
    t0: float
    t1: float = math.inf
    acknowledged: bool = False


@dataclass
class Anomaly:
    rule: str
    what: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.what}"


@dataclass
class Life:
    """One run of the daemon: from its start to its stop, `clean` (SIGTERM) or not (SIGKILL)."""
    start: float
    end: float = math.inf
    clean: bool = True


@dataclass
class History:
    """What one run recorded, and the store's promise for misses ("none", "write_back",
    "write_through")."""
    promise: str = "none"
    puts: dict = field(default_factory=lambda: defaultdict(list))  # (ns, key) -> [Put]
    deletes: dict = field(default_factory=lambda: defaultdict(list))  # (ns, key) -> [Delete]
    reads: list = field(default_factory=list)  # (worker, op, ns, key, t0, t1, version | None | "bad: ...")
    groups: list = field(default_factory=list)  # (worker, ns, t0, t1, [(key, version | "bad...")] | None)
    lives: list = field(default_factory=list)
    num_ops: int = 0
    faults: dict = field(default_factory=lambda: defaultdict(int))  # fault -> times injected

    # --- loading what the workers wrote ------------------------------------------------

    def load(self, lines) -> None:
        """Records of one worker, JSON lines in order: a "begin" line per call and an "end"
        line per call that returned (a worker SIGKILLed leaves calls begun, never ended)."""
        begun: dict[int, dict] = {}
        for line in lines:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # the line a SIGKILL cut short
            if rec["e"] == "fault":
                self.faults[rec["kind"]] += 1
            elif rec["e"] == "begin":
                begun[rec["i"]] = rec
                self._begin(rec)
            else:
                self._end(begun.pop(rec["i"]), rec)
        for rec in begun.values():  # never ended
            self.num_ops += 1

    def _begin(self, rec: dict) -> None:
        if rec["op"] in ("put", "put_group"):
            for key in rec["keys"]:
                put = Put(rec["w"], rec["ns"], key, rec["v"], rec["t"], ttl_s=rec.get("ttl"))
                self.puts[(rec["ns"], key)].append(put)
                rec.setdefault("_puts", []).append(put)
        elif rec["op"] == "delete":
            for key in rec["keys"]:
                d = Delete(rec["ns"], key, rec["t"])
                self.deletes[(rec["ns"], key)].append(d)
                rec.setdefault("_deletes", []).append(d)

    def _end(self, begin: dict, rec: dict) -> None:
        self.num_ops += 1
        op, ns, t0, t1 = begin["op"], begin["ns"], begin["t"], rec["t"]
        out = rec.get("out")
        if op in ("put", "put_group"):
            outcomes = out if isinstance(out, list) else [out] * len(begin["_puts"])
            for put, outcome in zip(begin["_puts"], outcomes):
                put.outcome = outcome
                put.durability = rec.get("dur")
                if outcome != UNKNOWN:
                    put.t1 = t1
        elif op == "delete":
            for d in begin["_deletes"]:
                if out != UNKNOWN:
                    d.t1, d.acknowledged = t1, out == "ok"
        elif op in ("get", "get_into", "get_many", "get_many_into", "lookup"):
            if out == UNKNOWN or out is None:
                return
            for key, got in zip(begin["keys"], out):
                self.reads.append((begin["w"], op, ns, key, t0, t1, got))
        elif op == "get_group":
            if out != UNKNOWN:
                self.groups.append((begin["w"], ns, t0, t1, None if out is None else list(zip(begin["keys"], out))))

    # --- the rules ---------------------------------------------------------------------

    def check(self) -> list[Anomaly]:
        anomalies: list[Anomaly] = []
        for worker, op, ns, key, t0, t1, got in self.reads:
            anomalies += self._check_read(f"{worker} {op}", ns, key, t0, t1, got)
        for worker, ns, t0, t1, members in self.groups:
            if members is None:
                continue
            versions = set()
            for key, got in members:
                anomalies += self._check_read(f"{worker} get_group", ns, key, t0, t1, got)
                versions.add(got)
            if len(versions) > 1:
                anomalies.append(Anomaly("torn group", f"{worker} ns {ns} read members of puts {sorted(map(str, versions))}"))
        return anomalies

    def _check_read(self, who: str, ns: int, key: int, t0: float, t1: float, got) -> list[Anomaly]:
        where = f"{who} ns {ns} key {key} [{t0:.4f}, {t1:.4f}]"
        if isinstance(got, str) and got.startswith("bad"):
            return [Anomaly("foreign", f"{where}: {got}")]
        puts = self.puts.get((ns, key), [])
        if got is None or got == "miss":  # a miss, or a lookup's None
            lost = self._lost(ns, key, t0, t1)
            return [] if lost is None else [Anomaly("lost", f"{where}: missed {lost}")]
        if got == "held":  # a lookup's hit: some version is explained
            if any(self._alive(p, t0, t1) for p in puts):
                return []
            return [Anomaly("resurrected", f"{where}: a lookup found it; no put of it explains that")]
        candidates = [p for p in puts if p.version == got and p.t0 < t1 and p.may_be_stored()]
        if not candidates:
            return [Anomaly("phantom", f"{where}: version {got:#x} was never put before this read ended")]
        if any(self._alive(p, t0, t1) for p in candidates):
            return []
        if any(p.ttl_s is not None and t0 > p.t1 + p.ttl_s + TTL_MARGIN_S for p in candidates):
            return [Anomaly("expired", f"{where}: version {got:#x} read past its TTL")]
        deletes = [d for d in self.deletes.get((ns, key), []) if d.acknowledged]
        return [Anomaly("resurrected", f"{where}: version {got:#x} (put {[(p.t0, p.t1) for p in candidates]}) "
                                       f"read after the deletes {[(d.t0, d.t1) for d in deletes]}")]

    def _alive(self, put: Put, t0: float, t1: float) -> bool:
        """Could `put`'s version still be stored when a read [t0, t1] ran?"""
        if not put.may_be_stored() or put.t0 >= t1:
            return False
        if put.ttl_s is not None and t0 > put.t1 + put.ttl_s + TTL_MARGIN_S:
            return False
        return not any(d.acknowledged and d.t0 > put.t1 and d.t1 < t0 for d in self.deletes.get((put.ns, put.key), []))

    def _lost(self, ns: int, key: int, t0: float, t1: float) -> Put | None:
        """An acknowledged put this miss breaks the store's promise for, or None."""
        if self.promise == "none":
            return None
        deletes = self.deletes.get((ns, key), [])
        for put in self.puts.get((ns, key), []):
            if put.outcome not in STORED or put.t1 >= t0 or put.ttl_s is not None:
                continue
            if self.promise == "write_through" and put.durability not in ("sync", "group"):
                continue
            if self.promise == "write_back" and self._dirty_stop_between(put.t1, t0):
                continue  # only in memory when the daemon was SIGKILLed
            if any(d.t0 < t1 and d.t1 > put.t0 for d in deletes):
                continue  # a delete (acknowledged or not) may have removed it
            return put
        return None

    def _dirty_stop_between(self, a: float, b: float) -> bool:
        return any(not life.clean and a <= life.end <= b for life in self.lives)
