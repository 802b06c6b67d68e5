"""server/tiering/open_slots.py: a batch probed at once finds what each key probed alone finds."""

import numpy as np

from kvstore.server.tiering.open_slots import EMPTY, FEW, find, place


def test_find_hands_the_last_few_keys_to_the_scalar_probe_and_finds_the_same_rows():
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 1 << 62, 3000, dtype=np.int64)  # row i holds keys[i]
    slots = np.full(1 << 12, EMPTY, np.int32)
    mask = len(slots) - 1
    place(slots, np.arange(len(keys), dtype=np.int32), keys & mask)  # ~0.73 full: long probe chains
    asked = np.concatenate([keys[rng.integers(0, len(keys), 2000)], rng.integers(0, 1 << 62, 500, dtype=np.int64)])

    def matches(rows, which):
        return keys[rows] == asked[which]

    def one(which: int) -> int:
        alone.append(which)
        at = int(asked[which]) & mask
        while (row := int(slots[at])) != EMPTY:
            if keys[row] == asked[which]:
                return row
            at = (at + 1) & mask
        return -1
    alone: list[int] = []
    rows = find(slots, asked & mask, matches)
    assert find(slots, asked & mask, matches, one).tolist() == rows.tolist()
    assert 0 < len(alone) <= FEW  # the stragglers only
    expected = {int(k): i for i, k in enumerate(keys)}
    assert rows.tolist() == [expected.get(int(k), -1) for k in asked]
