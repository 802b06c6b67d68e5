"""Open-addressing slot tables over numpy rows: the marks and the vectorised placement that
the NVMe table (server/tiering/nvme_table.py) and the host index (object_table.py) share.

A slot holds a row number, EMPTY (never used) or GONE (a removed row's tombstone); a row is
found by probing linearly from its home slot up to the first EMPTY one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

EMPTY, GONE = -1, -2  # a slot's marks: never used, and a removed row's (a tombstone)


def place(slots: np.ndarray, rows: np.ndarray, at: np.ndarray,
          twins: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None) -> int:
    """Put `rows` into `slots` (a power of two long), each from its home slot `at`, in
    rounds: every row still unplaced tries its next slot, and of rows that try the same empty
    slot one wins. A row moves on only past an occupied slot or a tombstone (never reused
    here), so each is found by probing from its home. twins(occupants, rows): which rows
    have the key of the row placed where they tried (duplicates); those are left out.
    Returns how many were left out."""
    mask, left_out = len(slots) - 1, 0
    while len(rows):
        empty = slots[at] == EMPTY
        slots[at[empty]] = rows[empty]  # of rows trying one slot, the last write wins
        occupant = slots[at]
        lost = occupant != rows
        rows, at, occupant = rows[lost], at[lost], occupant[lost]
        if twins is not None and len(rows):
            twin = twins(occupant, rows)
            if twin.any():  # twins meet on their common probe path
                left_out += int(twin.sum())
                rows, at = rows[~twin], at[~twin]
        at = (at + 1) & mask
    return left_out


# Keys left probing when find hands them to `one`: a round of numpy steps costs ~30 us
# whatever it probes, and the last keys of a batch are a long probe chain's, a round each.
FEW = 32


def find(slots: np.ndarray, at: np.ndarray, matches: Callable[[np.ndarray, np.ndarray], np.ndarray],
         one: Callable[[int], int] | None = None) -> np.ndarray:
    """The row holding each of many keys, all probed at once from their home slots `at`
    (-1: not there). matches(rows, keys): for rows found on the way (>= 0) and the indexes
    of the keys they were found for, which of them hold those keys. one(key): the row of one
    key probed alone (the table's own lookup), for the last FEW keys still probing."""
    mask = len(slots) - 1
    found = np.full(len(at), -1, np.int64)
    pending, at = np.arange(len(at)), at.astype(np.int64)
    while len(pending):
        if one is not None and len(pending) <= FEW:
            found[pending] = [one(key) for key in pending.tolist()]
            break
        rows = slots[at].astype(np.int64)
        hit = rows >= 0
        hit[hit] = matches(rows[hit], pending[hit])
        found[pending[hit]] = rows[hit]
        going = ~hit & (rows != EMPTY)  # past a tombstone or another key: probe on
        pending, at = pending[going], (at[going] + 1) & mask
    return found
