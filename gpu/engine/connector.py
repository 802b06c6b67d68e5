"""Engine connector: load a prompt's prefix state from the store, save what the engine computes.

Shaped like vLLM's KV connector (KVConnectorBase_V1), so a vLLM adapter is a thin shim:

    vLLM                           here
    get_num_new_matched_tokens  -> get_num_new_matched_tokens(request_id, token_ids)   one lookup
    start_load_kv               -> start_load_kv(request_id)        reads and imports the chunks
    wait_for_layer_load         -> wait_for_layer_load(request_id, layer)  (no-op: objects hold
                                   every layer, so a load is complete when start_load_kv returns)
    save_kv_layer               -> save_kv(request_id, token_ids, num_computed_tokens)
    wait_for_save               -> wait_for_save()   one put_many per state kind, one put_group
                                   per chunk saved with the snapshots at its end
    request_finished            -> request_finished(request_id, token_ids, num_computed_tokens)

Engine-agnostic and tensor-free: the engine side passes one `StateCodec` per kind of state it
keeps (KV of attention layers; for hybrid models also recurrent snapshots). A codec owns the
conversion between the engine's tensors and the object's bytes (dtype casts, fp8, mxfp8;
store_codecs.py here), so this module and its parts (connector_objects, connector_plan,
connector_ranged) import neither torch nor the engine: they deal in bytes and numpy views. It
lives beside the reference engine, its user (store_engine, hybrid_engine, `kvstore demo`).
Keys follow kvstore-key-v1 (`kvstore.identity`): one chain over the token ids, one object id
per codec descriptor.

Hybrid models (codecs with `boundary_only`): a recurrent snapshot is only ever stored, found
and read with the chunk it ends, as one store group (connector_objects): a chunk whose
end has every snapshot is saved with them by put_group; a hit ends where such a group is
complete (lookup_groups) and every earlier chunk is held; the load reads that last chunk and
its snapshots with get_group. KV is never imported without the state after it.

Every store failure (daemon down, miss after lookup, checksum, timeout, full) becomes a
recompute: nothing is imported unless every object of the load was leased first, so the
engine's output is the same with the store or without it. The store is reached through one
`client.fail_soft.FailSoftLink` (`link`): after a failure the connector skips the store for
`retry_after_s`, then reconnects. One thread drives a connector.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.identity import ChunkKey, StateDescriptor, chunk_keys, namespace_salt
from kvstore.client.fail_soft import FailSoftLink

from .connector_objects import ChunkObjects
from .connector_plan import plan_load
from .connector_ranged import SegmentReader

# Load-rate guess when a lookup has no hit bytes to derive one from (host memcpy speed here).
DEFAULT_LOAD_S_PER_BYTE = 1 / 4e9


class StateCodec(Protocol):
    """The engine side of one kind of state. Called from the connector's thread only."""

    descriptor: StateDescriptor  # kind, dtype and layout of the objects this codec writes
    boundary_only: bool  # True: the state after a chunk (recurrent snapshot), stored in that chunk's group

    def export(self, request_id, start_token: int, end_token: int):
        """The object bytes (bytes-like, numpy or CPU tensor, descriptor.object_bytes long)
        for the state of tokens [start, end) (for boundary codecs: the state after end), or
        None when the engine does not have it. The result is the caller's."""

    def load(self, request_id, start_token: int, end_token: int, data: np.ndarray) -> None:
        """Import object bytes `data` (uint8, valid only during the call: copy what you keep)."""


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    extra_keys: tuple = ()  # kvstore-key-v1 extra keys of every chunk (a LoRA id, ...)
    secret: bytes | None = None  # namespace secret, when the deployment uses one
    timeout_s: float = 5.0  # any one store call; past it the daemon counts as down
    retry_after_s: float = 1.0  # after a failure, recompute without asking the store this long
    min_gain_s: float = 0.0  # load only when it beats recompute by more than this
    # False: the chunk holding the last prompt token is always computed, never loaded (an
    # engine with chunk-aligned prefill then computes it in the same piece as without a store)
    load_last_chunk: bool = True

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.retry_after_s < 0 or self.min_gain_s < 0:
            raise InvalidArgument("ConnectorConfig: timeout_s > 0, retry_after_s >= 0, min_gain_s >= 0")
        object.__setattr__(self, "extra_keys", tuple(self.extra_keys))


@dataclass(frozen=True, slots=True)
class MatchResult:
    num_tokens: int  # leading prompt tokens to load (0: recompute all)
    num_hit_tokens: int  # leading prompt tokens the store holds (loaded or not)
    tiers: tuple  # tier of each chunk to load ("host", "nvme", ...)
    est_load_s: float
    est_recompute_s: float
    reason: str  # "load", "miss", "no_snapshot", "recompute_faster", "too_short", "store_error", "evicted"


@dataclass(slots=True)
class ConnectorStats:
    num_lookups: int = 0
    num_loaded_tokens: int = 0
    num_saved_objects: int = 0  # members of saved groups included
    num_saved_groups: int = 0  # store groups saved: a chunk's objects and the snapshots at its end
    num_loaded_groups: int = 0  # loads whose last chunk and snapshots came as one group read
    bytes_loaded: int = 0
    bytes_saved: int = 0
    load_s: float = 0.0
    save_s: float = 0.0
    last_error: str = ""  # the last failed put (store failures: `KVConnector.link`)


@dataclass(slots=True)
class _Request:
    keys: list[ChunkKey] = field(default_factory=list)
    stored: list[list[bool]] | None = None  # per codec, per chunk; boundary codecs: its group is complete (None: unknown)
    match: MatchResult | None = None
    saved_chunks: int = 0  # chunks [0, saved_chunks) are stored or queued


class KVConnector:
    def __init__(self, socket_path: str | None, codecs: Sequence[StateCodec],
                 prefill_s: Callable[[int], float], config: ConnectorConfig = ConnectorConfig()):
        """prefill_s(tokens): the engine's estimate of computing that many prompt tokens."""
        if not codecs or codecs[0].boundary_only:
            raise InvalidArgument("the first codec must keep one object per chunk (KV)")
        first = codecs[0].descriptor
        for codec in codecs:
            d = codec.descriptor
            if (d.namespace, d.model, d.model_revision, d.chunk_tokens) != \
                    (first.namespace, first.model, first.model_revision, first.chunk_tokens):
                raise InvalidArgument("codecs of one connector must share namespace, model, "
                                      "revision and chunk_tokens")
        self.socket_path = socket_path
        self.codecs = list(codecs)
        self.config = config
        self.chunk_tokens = first.chunk_tokens
        self.stats = ConnectorStats()
        self._prefill_s = prefill_s
        self.objects = ChunkObjects(self.codecs, namespace_salt(first.namespace, config.secret))
        self._boundary = bool(self.objects.boundary)
        self.link = FailSoftLink(socket_path, first.namespace, config.timeout_s, config.retry_after_s)
        self.segments = SegmentReader(self.link, first, self._keys)
        self._pending: list[tuple[int, ChunkKey, object]] = []  # (codec, key, bytes): put alone
        self._pending_groups: list[list[tuple[int, ChunkKey, object]]] = []  # each put as one group
        self._requests: dict = {}

    def _keys(self, token_ids) -> list[ChunkKey]:
        return chunk_keys(token_ids, self.codecs[0].descriptor, self.config.extra_keys,
                          secret=self.config.secret)

    # -- load -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request_id, token_ids, num_computed_tokens: int = 0) -> MatchResult:
        """Ask the store how much of the prompt it holds (one lookup; for a hybrid model one
        lookup_groups more) and decide how much to load (remembered for start_load_kv).
        Loads nothing unless it goes past num_computed_tokens, the tokens the engine holds."""
        req = self._requests[request_id] = _Request(keys=self._keys(token_ids))
        C = self.chunk_tokens
        # A hybrid model must compute at least the last prompt token after its snapshot.
        usable = (len(token_ids) - (0 if self.config.load_last_chunk and not self._boundary else 1)) // C
        if usable * C <= num_computed_tokens:
            req.match = MatchResult(0, 0, (), 0.0, 0.0, "too_short")
            return req.match
        found = self.link.call(lambda client: self.objects.look_up(client, req.keys, usable))
        if found is None:
            req.match = MatchResult(0, 0, (), 0.0, 0.0, "store_error")
            return req.match
        self.stats.num_lookups += 1
        req.stored = [[t is not None for t in row] for row in found.tiers]
        rate = found.est_load_s / found.hit_bytes if found.hit_bytes else DEFAULT_LOAD_S_PER_BYTE
        plan = plan_load(req.stored, [c.boundary_only for c in self.codecs],
                         [c.descriptor.object_bytes for c in self.codecs], usable, C, rate,
                         self._prefill_s, self.config.min_gain_s)
        req.match = MatchResult(plan.num_chunks * C, plan.num_hit_chunks * C,
                                tuple(found.tiers[0][:plan.num_chunks]), plan.est_load_s,
                                plan.est_recompute_s, plan.reason)
        return req.match

    def match(self, request_id) -> MatchResult | None:
        """The request's latest decision (a failed load turns it into a recompute)."""
        req = self._requests.get(request_id)
        return None if req is None else req.match

    def start_load_kv(self, request_id) -> int:
        """Lease every object of the plan (a hybrid model's last chunk and its snapshots in
        one group read), then hand each to its codec: per-chunk codecs chunk by chunk, then
        the snapshots. Returns the prompt tokens loaded (0: nothing was imported,
        recompute). Leases end before it returns."""
        req = self._requests.get(request_id)
        if req is None or req.match is None or req.match.num_tokens == 0:
            return 0
        C, n = self.chunk_tokens, req.match.num_tokens // self.chunk_tokens
        wanted = [(c, j) for c, codec in enumerate(self.codecs)
                  for j in ([n - 1] if codec.boundary_only else range(n))]
        started = time.perf_counter()
        leases = self.link.call(lambda client: self.objects.lease(client, req.keys, n))
        if not leases:
            req.match = replace(req.match, num_tokens=0, tiers=(),
                                reason="store_error" if leases is None else "evicted")
            return 0
        try:
            for c, j in wanted:
                self.codecs[c].load(request_id, j * C, (j + 1) * C, leases[(c, j)].numpy())
                self.stats.bytes_loaded += leases[(c, j)].size
        finally:
            for lease in leases.values():
                lease.release()
        self.stats.num_loaded_tokens += n * C
        self.stats.num_loaded_groups += self._boundary
        self.stats.load_s += time.perf_counter() - started
        return n * C

    def wait_for_layer_load(self, request_id, layer: int) -> None:
        """Kept for the vLLM shape: start_load_kv has loaded every layer already."""

    def read_segments(self, request_id, token_ids, wanted: dict) -> dict | None:
        """Ranged reads for sparse attention (see connector_ranged): {chunk: [(layer,
        block), ...]} of the first codec's objects -> {(chunk, layer, block): uint8 array}."""
        return self.segments.read(request_id, token_ids, wanted)

    # -- save -----------------------------------------------------------------------------

    def save_kv(self, request_id, token_ids, num_computed_tokens: int) -> int:
        """Queue the objects of every full chunk computed since the last call and not known
        to be stored; returns how many were queued. A chunk whose end has every snapshot is
        queued whole with them as one group (unless that group is known complete); other
        chunks queue their per-chunk objects alone and no snapshot. Cheap when no chunk was
        completed."""
        req = self._requests.setdefault(request_id, _Request())
        done = min(num_computed_tokens, len(token_ids)) // self.chunk_tokens
        if done <= req.saved_chunks:
            return 0
        first, req.saved_chunks = req.saved_chunks, done
        if self.link.down:
            return 0  # the store is down: do not spend time exporting
        if len(req.keys) < done:
            req.keys = self._keys(token_ids[:done * self.chunk_tokens])
        queued = 0
        for j in range(first, done):
            held = ([j < len(row) and row[j] for row in req.stored] if req.stored is not None
                    else [False] * len(self.codecs))
            group = None
            if self._boundary and not held[self.objects.boundary[0]]:  # its group is not known complete
                group = self._export_group(request_id, req.keys[j], j)
            if group is not None:
                self._pending_groups.append(group)
                queued += len(group)
                continue
            for c in self.objects.per_chunk:
                data = None if held[c] else self._export(request_id, c, j)
                if data is not None:
                    self._pending.append((c, self.objects.key(req.keys[j], c), data))
                    queued += 1
        return queued

    def _export(self, request_id, c: int, j: int):
        return self.codecs[c].export(request_id, j * self.chunk_tokens, (j + 1) * self.chunk_tokens)

    def _export_group(self, request_id, key: ChunkKey, j: int) -> list | None:
        """Chunk j's group members (codec, key, bytes), or None when the engine lacks one."""
        data = {}
        for c in self.objects.boundary + self.objects.per_chunk:  # snapshots first: often absent
            data[c] = self._export(request_id, c, j)
            if data[c] is None:
                return None
        return [(c, self.objects.key(key, c), data[c]) for c in self.objects.member_codecs()]

    def wait_for_save(self) -> int:
        """Store everything queued (one put_many per codec, one put_group per queued group);
        returns the objects stored. Failures drop the queue: the state stays in the engine,
        and later runs recompute. A group is stored whole or not at all."""
        if not self._pending and not self._pending_groups:
            return 0
        singles, self._pending = self._pending, []
        groups, self._pending_groups = self._pending_groups, []
        started = time.perf_counter()
        saved = self.link.call(lambda client: self.objects.put(client, singles, groups))
        stored = saved.codecs if saved is not None else []
        if saved is not None and saved.errors:
            self.stats.last_error = f"{len(saved.errors)} puts failed: {saved.errors[0]}"
        self.stats.num_saved_objects += len(stored)
        self.stats.num_saved_groups += saved.num_groups if saved is not None else 0
        self.stats.bytes_saved += sum(self.codecs[c].descriptor.object_bytes for c in stored)
        self.stats.save_s += time.perf_counter() - started
        return len(stored)

    def request_finished(self, request_id, token_ids, num_computed_tokens: int) -> int:
        """Save the request's remaining full chunks, release its leases and forget it."""
        self.save_kv(request_id, token_ids, num_computed_tokens)
        stored = self.wait_for_save()
        self._requests.pop(request_id, None)
        self.segments.release(request_id)
        return stored

    def close(self) -> None:
        self._requests.clear()
        self.segments.close()
        self.link.close()
