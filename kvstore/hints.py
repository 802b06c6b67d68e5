"""Hints that travel with a put and steer placement and eviction."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from kvstore.errors import InvalidArgument
from kvstore.route import packed_route, route_json
from kvstore.units import MAX_DURATION_S, check_seconds

# A session or branch id is a label, not data; keep frames small.
MAX_LABEL_CHARS = 128


@dataclass(frozen=True, slots=True)
class Hints:
    """Advice from the producer. Every field is optional; none changes what a get returns.

    ttl_s: drop the object this many seconds after put, 0..MAX_DURATION_S (a century; None:
        never expires). It counts from the put on every tier and node: past it the object is
        a miss in host memory, on NVMe (also after a restart), once promoted back, and in
        copies fetched from peers or a Mooncake pool (node clocks must agree to within what
        the TTL tolerates).
    priority: -10..10, higher is kept longer under pressure.
    session_id / branch_id: agent session and branch the state belongs to.
    next_access_s: when the producer expects the next read, in seconds from now (0..MAX_DURATION_S).
    recompute_cost_ms: what a miss would cost the engine (0..MAX_DURATION_S * 1000); drives
        cost-aware eviction.
    pin: keep resident in the host tier until unpinned.
    route: the engine's names for the object's blocks (kvstore.route.Route; kept packed), which
        the daemon's KV events for routers publish (`[events]`).

    Every field is checked when the hints are made (InvalidArgument naming it and its range),
    so a put, waited or deferred, never carries hints the wire or the daemon would refuse.
    """

    ttl_s: float | None = None
    priority: int = 0
    session_id: str | None = None
    branch_id: str | None = None
    next_access_s: float | None = None
    recompute_cost_ms: float | None = None
    pin: bool = False
    route: bytes | None = None

    def __post_init__(self) -> None:
        for name in ("ttl_s", "next_access_s"):
            if (value := getattr(self, name)) is not None:
                check_seconds(value, f"hint {name}")
        if self.recompute_cost_ms is not None:
            check_seconds(self.recompute_cost_ms, "hint recompute_cost_ms", MAX_DURATION_S * 1000, "milliseconds")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool) or not -10 <= self.priority <= 10:
            raise InvalidArgument(f"hint priority must be an integer in -10..10, got {self.priority!r}")
        for name in ("session_id", "branch_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or len(value) > MAX_LABEL_CHARS):
                raise InvalidArgument(f"hint {name} must be a string of at most {MAX_LABEL_CHARS} characters")
        if not isinstance(self.pin, bool):
            raise InvalidArgument(f"hint pin must be a bool, got {self.pin!r}")
        if self.route is not None:
            object.__setattr__(self, "route", packed_route(self.route))

    def with_route(self, route) -> Hints:
        """These hints with `route` (a Route, packed bytes or None) in place of theirs."""
        packed = packed_route(route)
        if packed == self.route:
            return self
        return replace(self, route=packed)

    def to_json(self) -> dict:
        """Every field, as the admin API shows hints: the route unpacked, its bytes as hex."""
        doc = {k: getattr(self, k) for k in _FIELD_NAMES}
        doc["route"] = None if self.route is None else route_json(self.route)
        return doc

    def to_wire(self) -> dict:
        """Only the fields that differ from the default, to keep frames small."""
        if self is _DEFAULT:
            return {}
        return {k: v for k in _FIELD_NAMES if (v := getattr(self, k)) != getattr(_DEFAULT, k)}

    @staticmethod
    def of(hints) -> Hints:
        """`hints` if it is a Hints, the default Hints for None; else InvalidArgument (a put
        checks its hints when it is made, not when it is sent)."""
        if hints is None:
            return _DEFAULT
        if not isinstance(hints, Hints):
            raise InvalidArgument(f"hints must be a kvstore.hints.Hints or None, got {type(hints).__name__}")
        return hints

    @classmethod
    def from_wire(cls, data) -> Hints:
        if data is None or data == {}:
            return _DEFAULT
        if not isinstance(data, dict):
            raise InvalidArgument("hints must be a map")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise InvalidArgument(f"unknown hint(s) {sorted(map(str, unknown))}")
        return cls(**data)

    @classmethod
    def from_record(cls, data) -> Hints:
        """Hints as a daemon stored them with an object (an NVMe record): as from_wire, but a
        duration past today's limit, stored before the limit existed, reads as the limit
        (a century, "never" in effect) instead of an error that would leave the object
        unreadable after an upgrade."""
        if isinstance(data, dict):
            limits = {"ttl_s": MAX_DURATION_S, "next_access_s": MAX_DURATION_S,
                      "recompute_cost_ms": MAX_DURATION_S * 1000}
            data = {k: min(v, limits[k]) if k in limits and isinstance(v, (int, float)) and not isinstance(v, bool)
                    and v == v else v for k, v in data.items()}
        return cls.from_wire(data)


_DEFAULT = Hints()
_FIELD_NAMES = tuple(f.name for f in fields(Hints))
