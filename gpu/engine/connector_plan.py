"""Load or recompute: how many leading chunks an engine should load.

Pure: no I/O. Given which objects the store holds for each chunk of a prompt, the load rate
the daemon estimated, and the engine's own prefill estimate, pick the prefix whose loading
saves the most time over recomputing it:

    for n in 1 .. usable chunks, while every per-chunk object of chunk n-1 is stored:
        if the model has boundary objects (recurrent snapshots), only where the store group
        of chunk n-1 (its objects and the snapshots at its end) is complete:
            gain(n) = prefill_s(n * chunk_tokens) - load_rate * bytes(n chunks + 1 snapshot)
    load the n with the largest gain, if that gain exceeds min_gain_s; else recompute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True, slots=True)
class LoadPlan:
    num_chunks: int  # leading chunks to load (0: recompute everything)
    num_hit_chunks: int  # leading chunks whose per-chunk objects are all stored
    est_load_s: float  # estimated load time of the chosen chunks
    est_recompute_s: float  # estimated prefill time of the same tokens
    reason: str  # "load", "miss", "no_snapshot", "recompute_faster"


def plan_load(
    stored: Sequence[Sequence[bool]],
    boundary_only: Sequence[bool],
    object_bytes: Sequence[int],
    usable_chunks: int,
    chunk_tokens: int,
    load_s_per_byte: float,
    prefill_s: Callable[[int], float],
    min_gain_s: float = 0.0,
) -> LoadPlan:
    """stored[c][j]: the object of codec c for chunk j is stored; for a boundary codec, that
    chunk j's store group is complete. boundary_only[c]: codec c needs only the object at
    the last loaded chunk (a recurrent snapshot). object_bytes[c]:
    the size of one object of codec c. prefill_s(tokens): the engine's estimate of computing
    that many prompt tokens from scratch."""
    per_chunk = [c for c, b in enumerate(boundary_only) if not b]
    boundary = [c for c, b in enumerate(boundary_only) if b]
    chunk_bytes = sum(object_bytes[c] for c in per_chunk)
    snapshot_bytes = sum(object_bytes[c] for c in boundary)
    best = LoadPlan(0, 0, 0.0, 0.0, "miss")
    best_gain, hits, any_boundary = min_gain_s, 0, False
    for j in range(usable_chunks):
        if not all(stored[c][j] for c in per_chunk):
            break
        hits = j + 1
        if not all(stored[c][j] for c in boundary):
            continue
        any_boundary = True
        load_s = load_s_per_byte * (hits * chunk_bytes + snapshot_bytes)
        recompute_s = prefill_s(hits * chunk_tokens)
        if recompute_s - load_s > best_gain:
            best_gain = recompute_s - load_s
            best = LoadPlan(hits, hits, load_s, recompute_s, "load")
    if best.num_chunks:
        return LoadPlan(best.num_chunks, hits, best.est_load_s, best.est_recompute_s, "load")
    if hits == 0:
        return LoadPlan(0, 0, 0.0, 0.0, "miss")
    if not any_boundary:
        return LoadPlan(0, hits, 0.0, 0.0, "no_snapshot")
    load_s = load_s_per_byte * (hits * chunk_bytes + snapshot_bytes)
    return LoadPlan(0, hits, load_s, prefill_s(hits * chunk_tokens), "recompute_faster")
