"""The built-in smoke workload: a real daemon, a real client, every state kind.

Starts a daemon in a temporary directory (unless a socket is given), stores chunks of
KV cache (bf16), MLA latents (fp8) and recurrent snapshots (fp32) for a token prefix,
looks the prefix up, reads everything back and verifies each byte by checksum.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import xxhash

from kvstore import StateDescriptor, chunk_keys
from kvstore.errors import ServiceError


class SmokeFailed(ServiceError):
    """The smoke workload did not get back what it stored, or its daemon did not start."""

    code = "smoke"


def start_daemon(socket_path: str, arena_bytes: str = "256MiB", extra=()) -> subprocess.Popen:
    """Start `kvstore serve` as a child process and wait until its socket answers.

    Unless `extra` says otherwise, the admin API takes a free port and the data directory
    sits beside the socket, so several such daemons never collide with each other or with
    the user's real one.
    """
    from kvstore.client import Client, DaemonUnavailable
    defaults = []
    if "--config" not in extra:
        if "--admin-port" not in extra:
            defaults += ["--admin-port", "0"]
        if "--data-dir" not in extra:
            defaults += ["--data-dir", os.path.join(os.path.dirname(os.path.abspath(socket_path)), "data")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.commands.cli", "serve", "--socket", socket_path,
         "--arena-bytes", arena_bytes, "--log-level", "warning", *defaults, *extra],
        stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SmokeFailed(f"daemon exited with code {proc.returncode} during start (its error is above)")
        try:
            Client.connect(socket_path, timeout_s=5).close()
            return proc
        except DaemonUnavailable:
            time.sleep(0.05)
    proc.kill()
    raise SmokeFailed("daemon did not become ready within 30 s")


def _workload(client, num_chunks: int) -> list[tuple[str, int, int, float, float]]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 49152, size=num_chunks * 256).tolist()
    kinds = [
        ("kv bf16", StateDescriptor("smoke", "SmolLM2-135M", "r1", "kv", "bf16",
                                    "paged(order=layer_first,layers=30,block=16,kv_heads=3,head_dim=64)")),
        ("mla fp8", StateDescriptor("smoke", "tiny-mla", "r1", "mla_latent", "fp8_e4m3",
                                    "mla(order=layer_first,layers=4,block=16,latent_dim=512,rope_dim=64)")),
        ("recurrent fp32", StateDescriptor("smoke", "tiny-hybrid", "r1", "recurrent", "fp32",
                                           "recurrent(layers=2,heads=4,k_dim=32,v_dim=32)")),
    ]
    rows = []
    for name, desc in kinds:
        keys = chunk_keys(tokens, desc)
        payloads = [rng.integers(0, 256, size=desc.object_bytes, dtype=np.uint8) for _ in keys]
        start = time.perf_counter()
        results = client.put_many(list(zip(keys, payloads)), desc)
        put_s = time.perf_counter() - start
        failed = [r.error for r in results if r.error]
        if failed:
            raise SmokeFailed(f"{name}: {len(failed)} puts failed, first: {failed[0]}")
        found = client.lookup(keys, namespace="smoke")
        if found.hits != len(keys):
            raise SmokeFailed(f"{name}: lookup found {found.hits} of {len(keys)} chunks just stored; "
                              f"{_too_small(client, len(keys) * desc.object_bytes)}")
        out = np.empty(desc.object_bytes, dtype=np.uint8)
        start = time.perf_counter()
        for key, payload in zip(keys, payloads):
            if client.get_into(key, out, namespace="smoke") != desc.object_bytes:
                raise SmokeFailed(f"{name}: chunk {key.index} missing; {_too_small(client, len(keys) * desc.object_bytes)}")
            if xxhash.xxh3_128_digest(out) != xxhash.xxh3_128_digest(payload):
                raise SmokeFailed(f"{name}: chunk {key.index} came back different")
        get_s = time.perf_counter() - start
        rows.append((name, len(keys), desc.object_bytes, put_s, get_s))
    return rows


def _too_small(client, needed_bytes: int) -> str:
    """Why chunks just stored can be gone: the arena evicted them to make room for the next."""
    ns = client.stats().get("namespaces", {}).get("smoke", {})
    capacity = ns.get("capacity_bytes")
    if capacity is not None and capacity < needed_bytes:
        return (f"the daemon's arena for namespace 'smoke' ({capacity / 2**20:.0f} MiB) is smaller than the "
                f"{needed_bytes / 2**20:.0f} MiB stored, so it evicted some ({ns.get('num_evictions', '?')} evictions); "
                "run it against a daemon with a larger host.arena_bytes, or with fewer --chunks")
    return f"evictions in namespace 'smoke': {ns.get('num_evictions', '?')}"


def run_smoke(socket_path: str | None, num_chunks: int) -> int:
    from kvstore.client import Client
    with tempfile.TemporaryDirectory(prefix="kvstore-smoke-") as tmp:
        proc = None
        if socket_path is None:
            socket_path = os.path.join(tmp, "kvstore.sock")
            print(f"starting a daemon at {socket_path} ...", flush=True)
            proc = start_daemon(socket_path)
        try:
            with Client.connect(socket_path, namespace="smoke") as client:
                rows = _workload(client, num_chunks)
                stats = client.stats()["namespaces"]["smoke"]
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(10)
    print(f"\n{'state kind':<16} {'chunks':>6} {'bytes/chunk':>12} {'put GB/s':>9} {'get_into GB/s':>14}  verified")
    for name, count, size, put_s, get_s in rows:
        print(f"{name:<16} {count:>6} {size:>12} {count * size / put_s / 1e9:>9.2f} {count * size / get_s / 1e9:>14.2f}  yes")
    print(f"\nnamespace 'smoke': {stats['objects']} objects, {stats['used_bytes'] / 2**20:.1f} MiB used, "
          f"{stats['num_hits']} hits, {stats['num_evictions']} evictions")
    print("smoke workload passed: every chunk read back bit-exact")
    return 0
