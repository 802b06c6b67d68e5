"""What one forward step computes: token segments of several sequences, flattened.

A step computes, for each scheduled sequence, the tokens [start, start + len(token_ids)) of it:
the whole prompt (or a chunk of it) in a prefill step, one token in a decode step. Linear layers
see all tokens of all segments as one [T, hidden] matrix; attention sees a padded batch
[B, Q, ...] against each sequence's context gathered from the paged cache [B, L, ...], with a
mask that is causal within the segment and open over the cached positions before it. Index
tensors are built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import PagedKVCache


@dataclass(frozen=True, slots=True)
class Segment:
    seq_id: int
    start: int                 # position of token_ids[0] in its sequence
    token_ids: list[int]


@dataclass(frozen=True, slots=True)
class StepBatch:
    token_ids: torch.Tensor       # [T] int64
    positions: torch.Tensor       # [T] int64
    write_slots: torch.Tensor     # [T] flat cache slot of each new token
    context_slots: torch.Tensor   # [B, L] flat cache slots of each sequence's context, padded
    query_index: torch.Tensor     # [B, Q] row of T for each (sequence, query), padded with 0
    query_valid: torch.Tensor     # [B, Q] bool
    attn_mask: torch.Tensor       # [B, 1, Q, L] bool, True = attend
    last_index: torch.Tensor      # [B] row of T of each segment's last token

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]


def build_batch(segments: list[Segment], cache: PagedKVCache) -> StepBatch:
    """Index tensors for one step. Pages for every token must already be allocated."""
    device = cache.config.device
    num_seqs = len(segments)
    q_max = max(len(s.token_ids) for s in segments)
    l_max = max(s.start + len(s.token_ids) for s in segments)
    context_slots = torch.zeros(num_seqs, l_max, dtype=torch.long, device=device)
    query_index = torch.zeros(num_seqs, q_max, dtype=torch.long)
    query_valid = torch.zeros(num_seqs, q_max, dtype=torch.bool)
    q_start = torch.zeros(num_seqs, dtype=torch.long)
    write_slots, positions, last_index, row = [], [], [], 0
    for b, seg in enumerate(segments):
        n, end = len(seg.token_ids), seg.start + len(seg.token_ids)
        slots = cache.slots(seg.seq_id, 0, end)
        context_slots[b, :end] = slots
        write_slots.append(slots[seg.start:])
        positions.append(torch.arange(seg.start, end))
        query_index[b, :n] = torch.arange(row, row + n)
        query_valid[b, :n] = True
        q_start[b] = seg.start
        row += n
        last_index.append(row - 1)
    # Query q of sequence b sits at position start_b + q and sees keys at positions <= it.
    # Padded query rows see at least key 0, so no softmax row is empty (no NaN); they are dropped.
    q_pos = q_start[:, None] + torch.arange(q_max)[None, :]
    mask = torch.arange(l_max)[None, None, :] <= q_pos[:, :, None]
    return StepBatch(
        token_ids=torch.tensor([t for s in segments for t in s.token_ids], device=device),
        positions=torch.cat(positions).to(device),
        write_slots=torch.cat(write_slots),
        context_slots=context_slots,
        query_index=query_index.to(device),
        query_valid=query_valid.to(device),
        attn_mask=mask[:, None].to(device),
        last_index=torch.tensor(last_index, device=device),
    )
