"""The engine adapters' own overhead: blocks stored and loaded per second through each
adapter, against a plain copy of the same bytes in the same run.

    .venv/bin/python bench/engines.py [--engines vllm,sglang,lmcache] [--quick]

Each engine's part runs in that engine's own environment (scripts/engine_env.sh makes it
when missing) against a daemon it starts (host tier only, 1 GiB arena); the parts print
their rows as JSON and this driver reports them together (bench/results/engines.json).

    vllm connector   wait_for_save / start_load_kv of whole 256-token chunks over CPU paged
                     caches (12 layers, 8 KV heads x 128, fp16: 6 MiB a chunk)
                     baseline: the same gather / scatter of the paged blocks plus one memcpy
                     of the chunk bytes (what any copy into or out of a store must do)
    vllm tier        submit_store / submit_load (+ drain_jobs) of 2 MiB primary-tier chunks
                     baseline: memcpy of the same chunks
    sglang, lmcache  their parts live in bench/engines_<engine>.py (`bench(socket_path, quick,
                     suite) -> list[Row]`)

Ratios are the adapter's rate / the baseline's rate (1.0 = as fast as the plain copy; lower
is slower); the absolute rates vary up to 3x between runs on this shared 2-core machine.
sglang: HiCache pages (24 layers, 64 tokens, 8x128 bf16: 6 MiB) through batch_set_v1 /
batch_get_v1, page_first and layer_first. lmcache: 24 MiB KV_2LTD chunks through batched_put
/ get. Every load is checked bit-exact before its row counts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.common import MiB, Row, median, report  # noqa: E402

SUITE = "engines"
ENGINES = ("vllm", "sglang", "lmcache")


def _timed(fn, reps: int) -> float:
    """Median seconds of fn() over reps runs (one warm-up first)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


def _rate_rows(case: str, blocks: int, ours_s: float, base_s: float, baseline: str) -> list[Row]:
    return [Row(SUITE, case, "throughput", "blk/s", blocks / ours_s, baseline, blocks / base_s)]


# --- vLLM ------------------------------------------------------------------------------


def bench_vllm(socket_path: str, quick: bool) -> list[Row]:
    import types

    import numpy as np
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    import adapters.vllm as connector_module
    from adapters.vllm_plan import LoadSpec, SaveSpec
    from kvstore.identity import ObjectId

    layers, heads, dim, block, chunk = 12, 8, 128, 16, 256
    per_chunk = chunk // block
    chunks = 8 if quick else 24
    num_blocks = chunks * per_chunk * 2
    spec = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=dim, dtype=torch.float16)
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec([f"l{i}" for i in range(layers)], spec)])
    vllm_config = types.SimpleNamespace(  # what the connector reads of a VllmConfig
        kv_transfer_config=types.SimpleNamespace(
            kv_connector_extra_config={"socket_path": socket_path, "chunk_tokens": chunk}, is_kv_producer=True),
        cache_config=types.SimpleNamespace(block_size=block, kv_cache_layout="NHD"),
        model_config=types.SimpleNamespace(model="bench/model", revision="main", use_mla=False),
        parallel_config=types.SimpleNamespace(rank=0, tensor_parallel_size=1, pipeline_parallel_size=1))
    worker = connector_module.KVStoreConnector(vllm_config, KVConnectorRole.WORKER, kv_config)
    caches = {f"l{i}": torch.randn(2, num_blocks, block, heads, dim).to(torch.float16) for i in range(layers)}
    worker.register_kv_caches(caches)
    rng = np.random.default_rng(0)
    rows = []
    src = [list(range(c * per_chunk, (c + 1) * per_chunk)) for c in range(chunks)]
    dst = [list(range((chunks + c) * per_chunk, (chunks + c + 1) * per_chunk)) for c in range(chunks)]
    reps = 3 if quick else 5

    def save_once():
        ids = [ObjectId(rng.bytes(32)) for _ in range(chunks)]
        worker.bind_connector_metadata(connector_module.KVStoreMetadata(
            [], [SaveSpec(oid, tuple(blocks)) for oid, blocks in zip(ids, src)]))
        worker.wait_for_save()
        worker.clear_connector_metadata()
        return ids

    chunk_bytes = worker.groups[0][0].object_bytes
    staging = np.empty(chunk_bytes, np.uint8)

    def plain_save():
        for blocks in src:
            index = torch.tensor(blocks)
            data = torch.stack([c.index_select(1, index).movedim(1, 0) for c in caches.values()]).contiguous()
            np.copyto(staging, data.view(-1).view(torch.uint8).numpy())

    ours = _timed(save_once, reps)
    base = _timed(plain_save, reps)
    rows += _rate_rows("vllm connector save", chunks * per_chunk, ours, base, "gather+memcpy")

    stored = save_once()

    def load_once():
        worker.bind_connector_metadata(connector_module.KVStoreMetadata(
            [LoadSpec(oid, tuple(enumerate(blocks))) for oid, blocks in zip(stored, dst)], []))
        worker.start_load_kv(None)
        worker.clear_connector_metadata()
        if worker.get_block_ids_with_load_errors():
            raise RuntimeError("bench: a load failed")

    source = np.empty(chunk_bytes, np.uint8)

    def plain_load():
        for blocks in dst:
            buf = torch.empty((layers, per_chunk, 2, block, heads, dim), dtype=torch.float16)
            np.copyto(buf.view(-1).view(torch.uint8).numpy(), source)
            index = torch.tensor(blocks)
            for layer, cache in enumerate(caches.values()):
                cache.index_copy_(1, index, buf[layer].movedim(0, 1))

    ours = _timed(load_once, reps)
    base = _timed(plain_load, reps)
    rows += _rate_rows("vllm connector load", chunks * per_chunk, ours, base, "memcpy+scatter")
    load_once()  # the baseline scribbled over dst: load again, then check what the loads wrote
    for i, (a, b) in enumerate(zip(src, dst)):  # the bench's loads must be right to count
        for cache in caches.values():
            if not torch.equal(cache[:, a], cache[:, b]):
                raise RuntimeError(f"bench: chunk {i} loaded wrong")
    worker.shutdown()
    rows += bench_vllm_tier(socket_path, quick)
    return rows


def bench_vllm_tier(socket_path: str, quick: bool) -> list[Row]:
    from unittest.mock import MagicMock

    import numpy as np
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    from adapters.vllm_tier import KVStoreSecondaryTier

    count, row = (16, 2 * MiB) if quick else (64, 2 * MiB)
    rows_mem = np.random.default_rng(1).integers(0, 256, (count * 2, row), dtype=np.uint8)
    tier = KVStoreSecondaryTier(MagicMock(), memoryview(rows_mem), "KVStoreSecondaryTier", socket_path=socket_path,
                                model="bench/model", dtype="fp16")
    ctx = ReqContext(req_id="bench")
    jobs = iter(range(1 << 30))
    rounds = iter(range(1 << 30))

    def store_once():
        r = next(rounds)
        keys = [make_offload_key(f"{r}-{i}".encode().ljust(32, b"."), 0) for i in range(count)]
        tier.submit_store(TransferJob(next(jobs), keys, np.arange(count), False, ctx))
        tier.drain_jobs()
        results = list(tier.get_finished_jobs())
        if not all(x.success for x in results):
            raise RuntimeError("bench: a tier store failed")
        return keys

    copies = np.empty((count, row), np.uint8)
    ours = _timed(store_once, 3)
    base = _timed(lambda: np.copyto(copies, rows_mem[:count]), 3)
    rows = _rate_rows("vllm tier store", count, ours, base, "memcpy")
    keys = store_once()

    def load_once():
        tier.submit_load(TransferJob(next(jobs), keys, np.arange(count, 2 * count), True, ctx))
        tier.drain_jobs()
        if not all(x.success for x in tier.get_finished_jobs()):
            raise RuntimeError("bench: a tier load failed")

    ours = _timed(load_once, 3)
    base = _timed(lambda: np.copyto(rows_mem[count:], copies), 3)
    rows += _rate_rows("vllm tier load", count, ours, base, "memcpy")
    tier.shutdown()
    return rows


def run_part(engine: str, quick: bool) -> list[dict]:
    """In the engine's environment: start a daemon, measure, return rows as dicts."""
    from commands.smoke import start_daemon

    with tempfile.TemporaryDirectory(prefix="kvs-bench-") as tmp:
        sock = os.path.join(tmp, "s.sock")
        proc = start_daemon(sock, "1GiB")
        try:
            if engine == "vllm":
                rows = bench_vllm(sock, quick)
            else:
                module = __import__(f"bench.engines_{engine}", fromlist=["bench"])
                rows = module.bench(sock, quick, SUITE)
        finally:
            proc.terminate()
            proc.wait(30)
    return [r.to_json() for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # internal: run one engine's part here
    args = parser.parse_args()
    if args.part:
        print("ROWS " + json.dumps(run_part(args.part, args.quick)))
        return
    rows, skipped = [], {}
    for engine in [e for e in args.engines.split(",") if e]:
        if engine != "vllm" and not os.path.exists(os.path.join(ROOT, "bench", f"engines_{engine}.py")):
            skipped[engine] = f"no bench/engines_{engine}.py yet"
            continue
        print(f"engines: {engine} (its environment: scripts/engine_env.sh {engine})", flush=True)
        python = subprocess.run([os.path.join(ROOT, "scripts", "engine_env.sh"), engine], check=True,
                                capture_output=True, text=True).stdout.strip()
        env = {**os.environ, "PYTHONPATH": ROOT, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
        done = subprocess.run([python, os.path.abspath(__file__), "--part", engine] + (["--quick"] if args.quick else []),
                              capture_output=True, text=True, env=env)
        found = [line for line in done.stdout.splitlines() if line.startswith("ROWS ")]
        if done.returncode != 0 or not found:
            skipped[engine] = f"its part failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"
            continue
        rows += [Row(**{k: v for k, v in r.items() if k != "ratio"}) for r in json.loads(found[-1][5:])]
    report(SUITE, rows, [], skipped, {"quick": args.quick, "engines": args.engines})


if __name__ == "__main__":
    main()
