"""CPU recipe: MHA KV host pool + Mamba host pool (SGLang classes), a v2 backend from the
factory, then the calls SGLang's HybridCacheController makes. Verified against HiCacheFile."""
import os, tempfile, torch
torch.set_num_threads(1)
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageConfig, HiCacheStorageExtraInfo, PoolHitPolicy,
                                                  PoolName, PoolTransfer, count_pool_hits)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

L, PAGE, H, D, DEV_TOK = 2, 4, 2, 8, 64
ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)
k = tuple(torch.zeros(DEV_TOK, H, D, dtype=torch.bfloat16) for _ in range(L)); v = tuple(torch.zeros_like(x) for x in k)
kv_info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
                        page_size=PAGE, head_num=H, head_dim=D, v_head_dim=D, dtype=torch.bfloat16, device=torch.device("cpu"))
kv = MHATokenToKVPoolHost(kv_info, 2.0, 0, PAGE, "page_first", pin_memory=False, device="cpu",
                          device_capacity_tokens=DEV_TOK, start_layer=0, end_layer=L)
# Mamba "device" state: [mamba_layers, slots, *shape]; conv is a tuple (one per conv state)
ML, SLOTS = 3, 8
m_info = MambaStateBufferInfo(temporal=torch.zeros(ML, SLOTS, 4, 16, 16, dtype=torch.float32),
                              conv=(torch.zeros(ML, SLOTS, 64, 3, dtype=torch.bfloat16),))
mamba = MambaPoolHost(m_info, 2.0, 0, device_capacity=SLOTS, pin_memory=False, device="cpu", layout="page_first")
for p in (kv, mamba):
    for b in ([p.kv_buffer] if isinstance(p.kv_buffer, torch.Tensor) else p.kv_buffer):
        b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape, dtype=torch.uint8))
print("kv", type(kv).__name__, kv.layout, kv.page_size, kv.size, tuple(kv.kv_buffer.shape))
print("mamba page_size", mamba.page_size, "size", mamba.size, "temporal", tuple(mamba.temporal_buffer.shape),
      mamba.temporal_dtype, "conv", [tuple(c.shape) for c in mamba.conv_buffer], mamba.conv_dtype,
      "bytes/slot", mamba.get_size_per_token())
print("mamba meta slot 3:", mamba.get_page_buffer_meta(torch.tensor([3])))
print("kv meta page 1:", kv.get_page_buffer_meta(torch.arange(4, 8)))

tmp = tempfile.mkdtemp()
cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                           is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                           model_name="org/model", extra_config={"file_storage_path": tmp,
                           "backend_name": "x", "module_path": "sglang.srt.mem_cache.hicache_storage", "class_name": "HiCacheFile"})
be = StorageBackendFactory.create_backend("dynamic", cfg, kv)   # -> HiCacheFile(cfg, {})
be.register_mem_pool_host(kv)                                   # anchor (KV) pool
for name, pool in ((PoolName.KV, kv), (PoolName.MAMBA, mamba)):  # HostPoolGroup.entries order
    be.register_mem_host_pool_v2(pool, name)
be.on_host_pools_registered()

tokens = list(range(3 * PAGE)); hashes = get_hash_str(tokens, None, page_size=PAGE)
kv_idx = torch.arange(0, 3 * PAGE)
# backup (write_storage -> _page_backup_with_stable_layout): sidecars via v2 first, then KV via v1/generic
res = be.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([5]), keys=[hashes[-1]],
                                    hit_policy=PoolHitPolicy.TRAILING_PAGES)], HiCacheStorageExtraInfo())
print("batch_set_v2", res, count_pool_hits(res))
print("KV batch_set (generic)", be.batch_set(hashes, [kv.get_data_page(i * PAGE) for i in range(3)]))
# prefetch hit query: all span hashes + placeholder Mamba transfer
q = be.batch_exists_v2(hashes, [PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"],
                                             hit_policy=PoolHitPolicy.TRAILING_PAGES)], HiCacheStorageExtraInfo())
print("batch_exists_v2", q)
# load: mamba keys re-aligned to last hit page, host slot allocated after the hit
dst = mamba.alloc(1)
g = be.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=dst, keys=[hashes[q.kv_hit_pages - 1]],
                                  hit_policy=PoolHitPolicy.TRAILING_PAGES)], HiCacheStorageExtraInfo())
print("batch_get_v2", g, "equal:", torch.equal(mamba.get_data_page(int(dst[0])), mamba.get_data_page(5)))
