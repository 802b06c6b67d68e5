"""SGLang's real host pools, built on CPU, and our backend made by SGLang's own factory (the
SGLang environment only: conftest.py skips this folder elsewhere)."""

import zlib

import torch
from sglang.srt.mem_cache.device_pool_info import (KVBufferLayout, KVBuffers, MambaStateBufferInfo, MHABufferInfo,
                                                   MLABufferInfo)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

LAYERS, PAGE, HEADS, HEAD_DIM, LORA_RANK, ROPE_DIM = 2, 4, 2, 8, 8, 4
DEVICE_TOKENS = 64  # the host pool gets 2x this (host_to_device_ratio) plus a padding page
CPU = torch.device("cpu")


def _pointers(tensors):
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def make_pool(kind: str, layout: str, dtype=torch.bfloat16, *, layers=LAYERS, page=PAGE, heads=HEADS,
              head_dim=HEAD_DIM, device_tokens=DEVICE_TOKENS, label: str = ""):
    """SGLang's MHATokenToKVPoolHost ("mha") or MLATokenToKVPoolHost ("mla") on CPU, its
    bytes random (a seed per kind, layout and label: an SWA pool's label tells its bytes
    from the KV pool's). The tests' pool is tiny; bench/engines_sglang.py passes a model's
    geometry."""
    if kind == "mha":
        k = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
        v = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
        info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=_pointers(k), v_data_ptrs=_pointers(v),
                                               layout=KVBufferLayout.NHD),
                             page_size=page, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
                             dtype=dtype, device=CPU)
        pool = MHATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers)
    else:
        rows = tuple(torch.zeros(device_tokens, 1, LORA_RANK + ROPE_DIM, dtype=dtype) for _ in range(layers))
        info = MLABufferInfo(buffers=rows, data_ptrs=_pointers(rows), layer_indices=tuple(range(layers)),
                             device_layer_num=layers, page_size=page, kv_lora_rank=LORA_RANK,
                             qk_rope_head_dim=ROPE_DIM, kv_cache_dim=LORA_RANK + ROPE_DIM, dtype=dtype, device=CPU)
        pool = MLATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers,
                                    target_layer_num=layers)
    return _randomized(pool, pool.kv_buffer, f"{kind}/{layout}{label}")


def _randomized(pool, buffers, seed: str):
    generator = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    for buffer in buffers if isinstance(buffers, (list, tuple)) else [buffers]:
        raw = buffer.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    return pool


MAMBA_LAYERS, MAMBA_SLOTS = 3, 8  # the host pool gets 2x the slots plus one


def make_mamba_pool(temporal=(4, 16, 16), convs=((64, 3),)):
    """SGLang's MambaPoolHost on CPU (page_first: its only zero-copy layout), one fp32
    temporal (SSM) state and bf16 conv states per slot, its bytes random. temporal=None: a
    conv-only model."""
    info = MambaStateBufferInfo(
        temporal=torch.zeros(MAMBA_LAYERS, MAMBA_SLOTS, *(temporal or (0,)), dtype=torch.float32),
        conv=tuple(torch.zeros(MAMBA_LAYERS, MAMBA_SLOTS, *shape, dtype=torch.bfloat16) for shape in convs))
    pool = MambaPoolHost(info, 2.0, 0, device_capacity=MAMBA_SLOTS, pin_memory=False, device="cpu",
                         layout="page_first")
    return _randomized(pool, [pool.temporal_buffer, *pool.conv_buffer], f"mamba/{temporal}/{convs}")


DSA_PAGE = 64  # DSA's indexer asserts 64-token pages


def make_dsa_pools(device_tokens=4 * DSA_PAGE):
    """An MLA KV host pool of 64-token pages and SGLang's DSA indexer host pool on it."""
    kv = make_pool("mla", "page_first", page=DSA_PAGE, device_tokens=device_tokens)
    device = DSATokenToKVPool(size=device_tokens, page_size=DSA_PAGE, kv_lora_rank=LORA_RANK, dtype=torch.bfloat16,
                              qk_rope_head_dim=ROPE_DIM, layer_num=LAYERS, device="cpu", index_head_dim=128,
                              enable_memory_saver=False, kv_cache_dim=LORA_RANK + ROPE_DIM,
                              index_buf_size=device_tokens)
    indexer = DSAIndexerPoolHost(make_dsa_indexer_pool_decl(device), kv, pin_memory=False, device="cpu")
    return kv, _randomized(indexer, indexer.index_k_with_scale_buffer, "dsa-indexer")


def storage_config(kind: str, layout: str, extra: dict, *, tp=(0, 1), pp=(0, 1), model="test-org/test-model",
                   tp_lcm_size=None):
    """The HiCacheStorageConfig SGLang's cache controller builds for one rank (with
    tp_lcm_size, should_split_heads as cache_controller.py sets it)."""
    split = kind != "mla" and layout == "page_head" and tp_lcm_size is not None and tp_lcm_size > tp[1]
    return HiCacheStorageConfig(tp_rank=tp[0], tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1], attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=kind == "mla", enable_storage_metrics=False,
                                is_page_first_layout=layout == "page_first", model_name=model,
                                tp_lcm_size=tp_lcm_size, should_split_heads=split, extra_config=dict(extra))


BACKEND = {"backend_name": "kvstore", "module_path": "kvstore.adapters.sglang", "class_name": "KVStoreHiCacheStorage"}


def create_backend(pool, kind: str, socket_path: str | None, *, interface_v1=True, tp=(0, 1), pp=(0, 1),
                   tp_lcm_size=None, **extra):
    """As SGLang's cache controller attaches a storage backend: the factory's "dynamic"
    backend from the extra config, then register_mem_pool_host."""
    extra = {**BACKEND, "interface_v1": int(interface_v1), "timeout_s": 2, "retry_after_s": 0.05, **extra}
    if socket_path is not None:
        extra["socket_path"] = socket_path
    config = storage_config(kind, pool.layout, extra, tp=tp, pp=pp, tp_lcm_size=tp_lcm_size)
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def create_hybrid_backend(kv_pool, kind: str, socket_path: str | None, sidecars: dict, **kwargs):
    """As SGLang's HybridCacheController attaches a backend: create_backend, then
    register_mem_host_pool_v2 for every pool (KV first), then on_host_pools_registered."""
    backend = create_backend(kv_pool, kind, socket_path, **kwargs)
    for name, pool in {PoolName.KV: kv_pool, **sidecars}.items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


def page_keys(num_pages: int, seed: int = 0, page: int = PAGE) -> list[str]:
    """SGLang's own page hashes (a chained SHA-256 per page) of random tokens."""
    tokens = torch.randint(0, 32000, (num_pages * page,), generator=torch.Generator().manual_seed(seed)).tolist()
    return get_hash_str(tokens, None, page_size=page)


def token_indices(pages, page_tokens: int = PAGE) -> torch.Tensor:
    """Host pool token indices of whole pages, as SGLang passes them (page by page)."""
    return torch.cat([torch.arange(p * page_tokens, (p + 1) * page_tokens) for p in pages])


def page_bytes(pool, page: int) -> torch.Tensor:
    return pool.get_data_page(page * pool.page_size, flat=True).contiguous().view(torch.uint8)
