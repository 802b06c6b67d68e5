"""Regenerate kvstore/vectors/key-v1.json. Run only when the scheme version changes:
the vectors are a published contract that other engines and routers check against."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from kvstore import StateDescriptor, chunk_keys, namespace_salt  # noqa: E402
from kvstore.identity import root_hash  # noqa: E402

CASES = [
    {"name": "two chunks, kv bf16, default namespace", "namespace": "default", "secret": None,
     "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "model_revision": "main", "kind": "kv", "dtype": "bf16",
     "layout": "paged(order=layer_first,layers=30,block=16,kv_heads=3,head_dim=64)", "shard": "0/1",
     "chunk_tokens": 16, "tokens": list(range(40)), "extra_keys": []},
    {"name": "tenant secret changes every id", "namespace": "tenant-a", "secret": "00" * 16,
     "model": "m", "model_revision": "r1", "kind": "kv", "dtype": "bf16",
     "layout": "paged(order=layer_first,layers=2,block=4,kv_heads=1,head_dim=8)", "shard": "0/1",
     "chunk_tokens": 4, "tokens": [1, 2, 3, 4, 5, 6, 7, 8], "extra_keys": []},
    {"name": "lora extra key, fp8 mla, tp shard 1/2", "namespace": "default", "secret": None,
     "model": "deepseek-ai/DeepSeek-V3", "model_revision": "abc123", "kind": "mla_latent", "dtype": "fp8_e4m3",
     "layout": "mla(order=layer_first,layers=61,block=64,latent_dim=512,rope_dim=64)", "shard": "1/2",
     "chunk_tokens": 64, "tokens": [4294967295] * 64 + [0] * 64, "extra_keys": ["lora:adapter-7"]},
    {"name": "recurrent snapshot, mxfp8 kv differ from bf16", "namespace": "default", "secret": None,
     "model": "m", "model_revision": "r1", "kind": "recurrent", "dtype": "fp32",
     "layout": "recurrent(layers=4,heads=8,k_dim=64,v_dim=64)", "shard": "0/1",
     "chunk_tokens": 8, "tokens": [7] * 16, "extra_keys": []},
]


def main() -> None:
    out = []
    for case in CASES:
        secret = bytes.fromhex(case["secret"]) if case["secret"] else None
        desc = StateDescriptor(case["namespace"], case["model"], case["model_revision"], case["kind"],
                               case["dtype"], case["layout"], case["shard"], case["chunk_tokens"])
        salt = namespace_salt(case["namespace"], secret)
        keys = chunk_keys(case["tokens"], desc, extra_keys=case["extra_keys"], secret=secret)
        out.append({**case, "expected": {
            "salt": salt.hex(),
            "h0": root_hash(salt, case["model"], case["model_revision"]).hex(),
            "chain": [k.logical.hex() for k in keys],
            "object_ids": [k.object_id.hex for k in keys],
        }})
    path = pathlib.Path(__file__).resolve().parents[1] / "kvstore" / "vectors" / "key-v1.json"
    path.write_text(json.dumps({"scheme": "kvstore-key-v1", "cases": out}, indent=1) + "\n")
    print(f"wrote {len(out)} cases to {path}")


if __name__ == "__main__":
    main()
