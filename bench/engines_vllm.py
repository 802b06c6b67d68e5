"""bench/engines.py's vLLM part (run in vLLM's environment): blocks stored and loaded per
second through the KV connector (adapters/vllm.py, its worker role driven as vLLM's model
runner drives it: register_kv_caches, bind_connector_metadata, wait_for_save / start_load_kv)
and the secondary tier (adapters/vllm_tier.py), against a plain copy of the same bytes.

    vllm connector         whole 256-token chunks over CPU paged caches (12 layers, 8 KV heads
                           x 128, fp16: 6 MiB a chunk)
                           baseline: the same gather / scatter of the paged blocks plus one
                           memcpy of the chunk bytes (what any copy into or out of a store must do)
    vllm connector hybrid  the same attention group and a Mamba group in vLLM's "align" mode:
                           4 layers of mamba2-370m's shape (conv state 3 x 2304 fp16, SSM state
                           32 x 64 x 128 fp32), 4.05 MiB a state. Save: each chunk with the state
                           at its end as one store group (as when prefill steps end on chunk
                           boundaries). Load: a hit, its chunks read alone and the last with its
                           state in one group read.
                           baseline: the attention gather / scatter + memcpy above, and a memcpy
                           of each state out of / into its Mamba block's rows
    vllm tier              submit_store / submit_load (+ drain_jobs) of 2 MiB primary-tier chunks
                           baseline: memcpy of the same chunks

Rates count the chunks' attention blocks (16 tokens each); in the hybrid rows a block also
carries its share of the states. What a case stored is deleted after it (the hybrid save's
after each round, untimed), so the rounds fit the bench daemon's 1 GiB arena. What the last
load wrote is checked bit-exact against its source before a row counts.
"""

from __future__ import annotations

import types

import numpy as np

from bench.common import MiB, Row
from bench.engines import _timed

LAYERS, HEADS, HEAD_DIM, BLOCK, CHUNK = 12, 8, 128, 16, 256
PER_CHUNK = CHUNK // BLOCK
MAMBA_LAYERS, MAMBA_STATES = 4, (((3, 2304), "float16"), ((32, 64, 128), "float32"))


def bench(socket_path: str, quick: bool, suite: str) -> list[Row]:
    chunks, reps = (8, 3) if quick else (24, 5)
    return (bench_connector(socket_path, chunks, reps, suite) + bench_hybrid(socket_path, chunks, reps, suite)
            + bench_tier(socket_path, quick, suite))


def _rate_rows(suite: str, case: str, blocks: int, ours_s: float, base_s: float, baseline: str) -> list[Row]:
    return [Row(suite, case, "throughput", "blk/s", blocks / ours_s, baseline, blocks / base_s)]


# --- the connector's worker over CPU caches --------------------------------------------------


class Caches:
    """A model's CPU caches as vLLM registers them, and the connector's worker over them.
    Attention layers: (2, num_blocks, 16, 8, 128) fp16, random. Mamba layers (`mamba`): a list
    of state tensors (num_blocks, *shape) each, allocated untouched (only the rows a bench
    writes take memory)."""

    def __init__(self, socket_path: str, chunks: int, mamba: bool = False):
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

        import kvstore.adapters.vllm as connector_module

        self.module = connector_module
        self.num_blocks = 2 * chunks * PER_CHUNK  # sources, then destinations
        attention = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float16)
        groups = [KVCacheGroupSpec([f"l{i}" for i in range(LAYERS)], attention)]
        self.kv = {f"l{i}": torch.randn(2, self.num_blocks, BLOCK, HEADS, HEAD_DIM).to(torch.float16)
                   for i in range(LAYERS)}
        caches = dict(self.kv)
        self.states = []  # per Mamba layer, its state tensors
        if mamba:
            shapes = tuple(shape for shape, _ in MAMBA_STATES)
            dtypes = tuple(getattr(torch, dtype) for _, dtype in MAMBA_STATES)
            names = [f"m{i}" for i in range(MAMBA_LAYERS)]
            groups.append(KVCacheGroupSpec(names, MambaSpec(block_size=BLOCK, shapes=shapes, dtypes=dtypes,
                                                            mamba_cache_mode="align")))
            self.states = [[torch.empty(self.num_blocks, *shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes)]
                           for _ in names]
            caches.update(zip(names, self.states))
        vllm_config = types.SimpleNamespace(  # what the connector reads of a VllmConfig
            kv_transfer_config=types.SimpleNamespace(
                kv_connector_extra_config={"socket_path": socket_path, "chunk_tokens": CHUNK}, is_kv_producer=True),
            cache_config=types.SimpleNamespace(block_size=BLOCK, kv_cache_layout="NHD"),
            model_config=types.SimpleNamespace(model="bench/model", revision="main", use_mla=False),
            parallel_config=types.SimpleNamespace(rank=0, tensor_parallel_size=1, pipeline_parallel_size=1))
        kv_config = KVCacheConfig(num_blocks=self.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.worker = connector_module.KVStoreConnector(vllm_config, KVConnectorRole.WORKER, kv_config)
        self.worker.register_kv_caches(caches)
        self.src = [list(range(c * PER_CHUNK, (c + 1) * PER_CHUNK)) for c in range(chunks)]
        self.dst = [list(range((chunks + c) * PER_CHUNK, (chunks + c + 1) * PER_CHUNK)) for c in range(chunks)]
        self.chunk_bytes = self.worker.groups[0][0].object_bytes
        self.state_bytes = self.worker.groups[1][0].object_bytes if mamba else 0

    def run(self, loads: list, saves: list) -> None:
        """One step of the worker: this metadata bound, its loads and saves done."""
        self.worker.bind_connector_metadata(self.module.KVStoreMetadata(loads, saves))
        self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        failed = self.worker.get_transfer_results(set()).failed_recving if self.states else ()
        if self.worker.get_block_ids_with_load_errors() or failed:
            raise RuntimeError("bench: a load failed")

    # --- the plain copies the baselines make ----------------------------------------------

    def gather(self, blocks: list[int], out: np.ndarray) -> None:
        import torch
        index = torch.tensor(blocks)
        data = torch.stack([c.index_select(1, index).movedim(1, 0) for c in self.kv.values()]).contiguous()
        np.copyto(out, data.view(-1).view(torch.uint8).numpy())

    def scatter(self, source: np.ndarray, blocks: list[int]) -> None:
        import torch
        buf = torch.empty((LAYERS, PER_CHUNK, 2, BLOCK, HEADS, HEAD_DIM), dtype=torch.float16)
        np.copyto(buf.view(-1).view(torch.uint8).numpy(), source)
        index = torch.tensor(blocks)
        for layer, cache in enumerate(self.kv.values()):
            cache.index_copy_(1, index, buf[layer].movedim(0, 1))

    def state_rows(self, block: int) -> list[np.ndarray]:
        """The bytes of every state of every Mamba layer in `block` (views)."""
        import torch
        return [t[block].view(-1).view(torch.uint8).numpy() for states in self.states for t in states]

    def copy_state(self, block: int, staging: np.ndarray, out: bool) -> None:
        """A state's bytes out of `block`'s rows into `staging` (out), or back in."""
        at = 0
        for row in self.state_rows(block):
            part = staging[at:at + row.size]
            if out:
                np.copyto(part, row)
            else:
                np.copyto(row, part)
            at += row.size

    def blocks_equal(self, a: list[int], b: list[int]) -> bool:
        return all(np.array_equal(c[:, a].numpy(), c[:, b].numpy()) for c in self.kv.values())


def _ids(rng, count: int) -> list:
    from kvstore.identity import ObjectId
    return [ObjectId(rng.bytes(32)) for _ in range(count)]


def bench_connector(socket_path: str, chunks: int, reps: int, suite: str) -> list[Row]:
    from kvstore.adapters.vllm_plan import LoadSpec, SaveSpec

    m = Caches(socket_path, chunks)
    rng = np.random.default_rng(0)
    stored = []

    def save_once():
        ids = _ids(rng, chunks)
        m.run([], [SaveSpec(oid, tuple(blocks)) for oid, blocks in zip(ids, m.src)])
        stored.extend(ids)
        return ids

    staging = np.empty(m.chunk_bytes, np.uint8)
    rows = _rate_rows(suite, "vllm connector save", chunks * PER_CHUNK, _timed(save_once, reps),
                      _timed(lambda: [m.gather(blocks, staging) for blocks in m.src], reps), "gather+memcpy")
    ids = save_once()

    def load_once():
        m.run([LoadSpec(oid, tuple(enumerate(blocks))) for oid, blocks in zip(ids, m.dst)], [])

    rows += _rate_rows(suite, "vllm connector load", chunks * PER_CHUNK, _timed(load_once, reps),
                       _timed(lambda: [m.scatter(staging, blocks) for blocks in m.dst], reps), "memcpy+scatter")
    load_once()  # the baseline scribbled over dst: load again, then check what the loads wrote
    for i, (a, b) in enumerate(zip(m.src, m.dst)):  # the bench's loads must be right to count
        if not m.blocks_equal(a, b):
            raise RuntimeError(f"bench: chunk {i} loaded wrong")
    m.worker.store.delete(stored)
    m.worker.shutdown()
    return rows


def bench_hybrid(socket_path: str, chunks: int, reps: int, suite: str) -> list[Row]:
    from kvstore.adapters.vllm_plan import LoadSpec, SaveSpec

    m = Caches(socket_path, chunks, mamba=True)
    state_src = [b[-1] for b in m.src]  # the state at a chunk's end, in a block of its own group
    for block in state_src + [m.dst[-1][-1]]:  # touch only the rows the bench uses
        for row in m.state_rows(block):
            row[:] = np.frombuffer(np.random.default_rng(block).bytes(row.size), np.uint8)
    rng = np.random.default_rng(1)
    last = chunks - 1

    def save_once():
        kv, states = _ids(rng, chunks), _ids(rng, chunks)
        groups = m.worker.num_saved_groups
        m.run([], [spec for c in range(chunks) for spec in (
            SaveSpec(kv[c], tuple(m.src[c]), 0, c, "bench"), SaveSpec(states[c], (state_src[c],), 1, c, "bench"))])
        if m.worker.num_saved_groups - groups != chunks:
            raise RuntimeError("bench: a store group was not put")
        return kv, states

    staging = np.empty(m.chunk_bytes, np.uint8)
    state_staging = np.empty(m.state_bytes, np.uint8)

    def plain_save():
        for blocks, state in zip(m.src, state_src):
            m.gather(blocks, staging)
            m.copy_state(state, state_staging, out=True)

    ours = _timed(save_once, reps, after=lambda ids: m.worker.store.delete(ids[0] + ids[1]))
    rows = _rate_rows(suite, "vllm connector hybrid save", chunks * PER_CHUNK, ours, _timed(plain_save, reps),
                      "gather+memcpy")
    kv, states = save_once()
    state_dst = m.dst[-1][-1]
    loads = [LoadSpec(kv[c], tuple(enumerate(m.dst[c])), 0, None, "bench") for c in range(last)]
    loads += [LoadSpec(kv[last], tuple(enumerate(m.dst[last])), 0, last, "bench"),
              LoadSpec(states[last], ((0, state_dst),), 1, last, "bench")]

    def plain_load():
        for blocks in m.dst:
            m.scatter(staging, blocks)
        m.copy_state(state_dst, state_staging, out=False)

    rows += _rate_rows(suite, "vllm connector hybrid load", chunks * PER_CHUNK, _timed(lambda: m.run(loads, []), reps),
                       _timed(plain_load, reps), "memcpy+scatter")
    m.run(loads, [])  # the baseline scribbled over dst: load again, then check what the loads wrote
    if not (all(m.blocks_equal(a, b) for a, b in zip(m.src, m.dst)) and all(
            np.array_equal(a, b) for a, b in zip(m.state_rows(state_src[last]), m.state_rows(state_dst)))):
        raise RuntimeError("bench: the hybrid prefix loaded wrong")
    m.worker.store.delete(kv + states)
    m.worker.shutdown()
    return rows


def bench_tier(socket_path: str, quick: bool, suite: str) -> list[Row]:
    from unittest.mock import MagicMock

    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from kvstore.adapters.vllm_tier import KVStoreSecondaryTier

    count, row = (16, 2 * MiB) if quick else (64, 2 * MiB)
    rows_mem = np.random.default_rng(1).integers(0, 256, (count * 2, row), dtype=np.uint8)
    tier = KVStoreSecondaryTier(MagicMock(), memoryview(rows_mem), "KVStoreSecondaryTier", socket_path=socket_path,
                                model="bench/model", dtype="fp16")
    ctx = ReqContext(req_id="bench")
    jobs = iter(range(1 << 30))
    rounds = iter(range(1 << 30))
    stored = []

    def store_once():
        r = next(rounds)
        keys = [make_offload_key(f"{r}-{i}".encode().ljust(32, b"."), 0) for i in range(count)]
        tier.submit_store(TransferJob(next(jobs), keys, np.arange(count), False, ctx))
        tier.drain_jobs()
        results = list(tier.get_finished_jobs())
        if not all(x.success for x in results):
            raise RuntimeError("bench: a tier store failed")
        stored.extend(keys)
        return keys

    copies = np.empty((count, row), np.uint8)
    ours = _timed(store_once, 3)
    base = _timed(lambda: np.copyto(copies, rows_mem[:count]), 3)
    rows = _rate_rows(suite, "vllm tier store", count, ours, base, "memcpy")
    keys = store_once()

    def load_once():
        tier.submit_load(TransferJob(next(jobs), keys, np.arange(count, 2 * count), True, ctx))
        tier.drain_jobs()
        if not all(x.success for x in tier.get_finished_jobs()):
            raise RuntimeError("bench: a tier load failed")

    ours = _timed(load_once, 3)
    base = _timed(lambda: np.copyto(rows_mem[count:], copies), 3)
    rows += _rate_rows(suite, "vllm tier load", count, ours, base, "memcpy")
    rows_mem[count:] = 0  # the baseline wrote the same bytes: clear them, load again, check
    load_once()
    if not np.array_equal(rows_mem[count:], rows_mem[:count]):
        raise RuntimeError("bench: the tier loaded wrong")
    tier.store.delete(tier.object_ids(stored))
    tier.shutdown()
    return rows
