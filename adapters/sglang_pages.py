"""What the SGLang backend stores for one host-pool page, and under which ids.

A page of SGLang's host pool is one or more parts, as the pool's own `get_page_buffer_meta`
names them (pointer, size): K then V for MHA in page_first layouts, one part for MLA, one part
per layer (and per K/V) in layer_first. Each part is one object, so a put reads straight from
the pool's memory and a get writes straight into it (`host_view`); the daemon's copy into and
out of its shared arena is the only copy.

Identity: the object id of part j of the page with SGLang page hash h is
`engine_object_id(desc_j, "sglang:<host layout>", "h#j")`. The descriptor carries the model
(SGLang's storage model name, which already names a pool's own page format), the revision
(extra config `model_revision`), the kind (`mla_latent` for MLA, `kv` otherwise), the dtype,
the slice of the model's state this rank holds (`storage_shard`), the page length in tokens,
and the part's exact size (`raw`; the daemon refuses any other size). The host layout goes
into the engine tag because the same bytes are ordered differently per layout. With
`tp_lcm_size` (`plan_for`'s split_factor) a page's parts are its head slices' K and V,
named and sharded as a rank of TP size tp_lcm_size names its whole page's.

A hybrid model's extra pools (SGLang's v2 interface, `sidecar_plan`) are planned the same
way under the engine tag "sglang:<host layout>:<pool>" (mamba, swa, indexer), so no extra
page is ever the KV page of the same hash: an SWA page is a KV page of its own pool; a
Mamba slot is its temporal (SSM) state, kind `recurrent`, and each conv state, kind `conv`,
each of its own dtype and a `mamba(layers, states)` layout that names its shape, keyed per
TP rank even in MLA models; a DSA indexer page is one `indexer` object (fp8_e4m3 keys with
their scales, as SGLang packs them), shared by TP ranks like the latent it rides on.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from kvstore.dtypes import DType
from kvstore.groups import MAX_GROUP_MEMBERS, Member
from kvstore.identity import Kind, ObjectId, Shard, StateDescriptor
from kvstore.layout import Layout
from kvstore.adapters.common import engine_object_id

_DTYPES = {"torch.bfloat16": DType.BF16, "torch.float16": DType.FP16, "torch.float32": DType.FP32,
           "torch.float8_e4m3fn": DType.FP8_E4M3, "torch.float8_e5m2": DType.FP8_E5M2}
# Pools that keep fp8 as raw bytes do not say which fp8: the extra config must.
_BYTE_DTYPES = {"torch.uint8", "torch.int8"}


def storage_shard(cfg, tp_sharded: bool | None = None, head_slice: tuple[int, int] = (0, 1)) -> Shard:
    """The slice of the model's state this rank holds, flattened to one index/count:
    pipeline stage, then TP rank where TP ranks hold different slices (`tp_sharded`; by
    default all but MLA: an MLA latent is the same on every TP rank, so all of them share
    one object, while a Mamba state is TP-sharded even in an MLA model), then the
    decode-context and attention-context ranks (each holds a disjoint slice of every page).
    head_slice (i, f): slice i of the f that a rank splits its heads into for `tp_lcm_size`,
    so the TP axis counts the ranks of tp_size * f, whose slices the same ids name."""
    axes = [(cfg.pp_rank, cfg.pp_size)]
    if (not cfg.is_mla_model) if tp_sharded is None else tp_sharded:
        axes.append((cfg.tp_rank * head_slice[1] + head_slice[0], cfg.tp_size * head_slice[1]))
    axes += [(cfg.dcp_rank, cfg.dcp_size), (cfg.attn_cp_rank, cfg.attn_cp_size)]
    index, count = 0, 1
    for rank, size in axes:
        index, count = index * size + rank, count * size
    return Shard(index, count)


def kv_dtype(pool_dtype: str, extra: dict) -> DType:
    """The stored dtype of a host pool of torch dtype `pool_dtype`. Raises ValueError naming
    the extra config key to set when the pool keeps fp8 as bytes."""
    if pool_dtype in _BYTE_DTYPES:
        if "kv_cache_dtype" not in extra:
            raise ValueError(f"kvstore: the host pool keeps its KV cache as {pool_dtype}; say which fp8 it "
                             'holds with "kv_cache_dtype" ("fp8_e4m3" or "fp8_e5m2") in '
                             "--hicache-storage-backend-extra-config")
        return DType.parse(extra["kv_cache_dtype"])
    if pool_dtype in _DTYPES:
        return _DTYPES[pool_dtype]
    raise ValueError(f"kvstore: a host pool of {pool_dtype} is not a dtype kvstore stores "
                     f"({', '.join(sorted(_DTYPES))})")


def base_descriptor(cfg, dtype: DType, page_tokens: int, namespace: str, extra: dict) -> StateDescriptor:
    """Everything of a KV part's descriptor but its size. Raises ValueError naming the
    extra config key to set when SGLang's config does not say enough."""
    model = cfg.model_name or extra.get("model")
    if not model:
        raise ValueError('kvstore: SGLang passed no model name; set "model" in '
                         "--hicache-storage-backend-extra-config")
    return StateDescriptor(namespace, str(model), str(extra.get("model_revision", "main")),
                           kind=Kind.MLA_LATENT if cfg.is_mla_model else Kind.KV, dtype=dtype,
                           shard=storage_shard(cfg), chunk_tokens=page_tokens)


def sized(base: StateDescriptor, nbytes: int) -> StateDescriptor:
    """`base` for an object of exactly `nbytes` (layout `raw`, which the daemon size-checks)."""
    # raw's parameter counts elements of the descriptor's dtype today; try bytes as well,
    # so the right one is picked whichever way the layout counts.
    for count in (nbytes // base.dtype.element_bytes, nbytes):
        desc = base.with_(layout=Layout.make("raw", bytes=count))
        if desc.object_bytes == nbytes:
            return desc
    raise ValueError(f"kvstore: no raw layout of {base.dtype.value} is {nbytes} bytes")


@dataclass(frozen=True, slots=True)
class PagePlan:
    """The parts of every page of one host pool, their descriptors and ids.

    part_bytes[j] is the size of part j of any page; groups pairs each distinct descriptor
    with the parts it describes (one put_many per group); page_desc describes a whole flat
    page, as SGLang's older get/set interface moves it (None for the v2 pools, which move
    only in parts)."""

    engine: str
    page_tokens: int
    part_bytes: tuple[int, ...]
    part_descs: tuple[StateDescriptor, ...]
    part_names: tuple[str, ...]  # "h#<name>" is part j's engine key
    groups: tuple[tuple[StateDescriptor, tuple[int, ...]], ...]
    page_desc: StateDescriptor | None

    @classmethod
    def build(cls, engine: str, part_descs, page_desc: StateDescriptor | None, part_names=None) -> PagePlan:
        """The plan of pages whose part j is stored under part_descs[j] (each sized: its
        object_bytes is the part's size) and named part_names[j] (default: j) by engine
        tag `engine`."""
        part_descs = tuple(part_descs)
        names = tuple(part_names) if part_names is not None else tuple(str(j) for j in range(len(part_descs)))
        groups: dict[StateDescriptor, list[int]] = {}
        for j, desc in enumerate(part_descs):
            groups.setdefault(desc, []).append(j)
        return cls(engine, part_descs[0].chunk_tokens, tuple(d.object_bytes for d in part_descs), part_descs,
                   names, tuple((d, tuple(js)) for d, js in groups.items()), page_desc)

    @property
    def num_parts(self) -> int:
        return len(self.part_bytes)

    def part_ids(self, key: str) -> list[ObjectId]:
        return [engine_object_id(desc, self.engine, f"{key}#{name}")
                for desc, name in zip(self.part_descs, self.part_names)]

    def members(self, key: str) -> list[Member]:
        """The page's parts as the members of one store group."""
        return [Member(oid, desc) for oid, desc in zip(self.part_ids(key), self.part_descs)]

    def views(self, num_pages: int, ptrs, sizes) -> list[list[np.ndarray]]:
        """Per page, views of its parts in the pool's memory, from the pool's answer to
        get_page_buffer_meta for `num_pages` pages. Raises ValueError when the pool answers
        other parts than it did when this plan was made."""
        parts = self.num_parts
        if len(ptrs) != num_pages * parts or tuple(sizes) != self.part_bytes * num_pages:
            raise ValueError(f"{num_pages} pages but {len(ptrs)} page parts of sizes {sorted(set(sizes))} "
                             f"(expected {parts} per page of sizes {self.part_bytes})")
        return [[host_view(ptrs[i * parts + j], n) for j, n in enumerate(self.part_bytes)] for i in range(num_pages)]

    def page_id(self, key: str) -> ObjectId:
        return engine_object_id(self.page_desc, self.engine, f"{key}#page")

    def leading_pages(self, found: list[bool], parts: int) -> int:
        """How many leading pages have all `parts` of their objects in `found`."""
        for page in range(len(found) // parts):
            if not all(found[page * parts:(page + 1) * parts]):
                return page
        return len(found) // parts


def plan_for(pool, cfg, namespace: str, extra: dict, pool_name: str = "", split_factor: int = 1) -> PagePlan:
    """The page plan of a KV-like host pool (the KV pool, or an SWA pool as `pool_name`):
    its parts from one page's buffer metadata. A pool_name goes into the engine tag, so an
    SWA page is never the KV page of the same hash.

    split_factor f > 1 (heterogeneous TP, `tp_lcm_size`; MHA in SGLang's page_head layout,
    where a page holds one head after another): each page is the K and V of each of f head
    slices (the pool's get_split_heads_page_buffer_meta), each stored as the page of a rank
    of TP tp_size * f, under the same ids such a rank gives its whole page."""
    import torch

    base = base_descriptor(cfg, kv_dtype(str(pool.dtype), extra), pool.logical_page_size, namespace, extra)
    engine = f"sglang:{pool.layout}" + (f":{pool_name}" if pool_name else "")
    page = pool.get_dummy_flat_data_page()
    page_desc = sized(base, page.numel() * page.element_size())
    if split_factor == 1:
        _, part_bytes = pool.get_page_buffer_meta(torch.arange(pool.logical_page_size))
        return PagePlan.build(engine, [sized(base, n) for n in part_bytes], page_desc)
    _, part_bytes = pool.get_split_heads_page_buffer_meta(torch.arange(pool.logical_page_size), split_factor)
    per_slice = len(part_bytes) // split_factor  # K and V
    descs = [sized(base.with_(shard=storage_shard(cfg, head_slice=(j // per_slice, split_factor))), n)
             for j, n in enumerate(part_bytes)]
    return PagePlan.build(engine, descs, page_desc, [str(j % per_slice) for j in range(len(descs))])


def _swa_plan(pool, cfg, namespace: str, extra: dict, page_tokens: int) -> PagePlan:
    """An SWA pool is another MHA (or MLA) host pool of KV's page size: kind kv (mla_latent)."""
    return plan_for(pool, cfg, namespace, extra, "swa")


def _mamba_plan(pool, cfg, namespace: str, extra: dict, page_tokens: int) -> PagePlan:
    """One Mamba host slot (SGLang keeps one state per radix node, under the node's last page
    hash): the temporal (SSM) state, kind recurrent, then each conv state, kind conv, in
    get_page_buffer_meta's order (a conv-only model has no temporal part). Each is one
    object of its own dtype, laid out as `mamba(layers, states=<shape>:<dtype>)` over the
    pool's Mamba layers. TP-sharded even in an MLA model, so keyed per TP rank."""
    import torch

    if getattr(pool, "slot_state_device_tensors", ()):
        raise ValueError("it has slot side states (extra_checkpoint_buffers), which SGLang's zero-copy page "
                         "metadata does not cover")
    _, part_bytes = pool.get_page_buffer_meta(torch.tensor([0]))
    states = [(Kind.RECURRENT, pool.temporal_dtype, pool.temporal_state_shape)] * bool(pool.temporal_state_elem_size)
    states += [(Kind.CONV, pool.conv_dtype, shape) for shape in pool.conv_state_shapes]
    if len(states) != len(part_bytes):
        raise ValueError(f"it has {len(part_bytes)} parts a slot, expected {len(states)}")
    base = base_descriptor(cfg, DType.FP32, page_tokens, namespace, extra)
    base = base.with_(shard=storage_shard(cfg, tp_sharded=True))
    descs = []
    for (kind, torch_dtype, shape), nbytes in zip(states, part_bytes):
        dtype = kv_dtype(str(torch_dtype), extra)
        shape = "x".join(map(str, shape))
        layout = Layout.make("mamba", layers=pool.num_mamba_layers, states=f"{shape}:{dtype.value}")
        descs.append(base.with_(kind=kind, dtype=dtype, layout=layout))
        if descs[-1].object_bytes != nbytes:
            raise ValueError(f"a slot's {kind.value} state is {nbytes} bytes, not {layout}")
    return PagePlan.build(f"sglang:{pool.layout}:mamba", descs, None)


def _indexer_plan(pool, cfg, namespace: str, extra: dict, page_tokens: int) -> PagePlan:
    """A DSA indexer page (it rides on the MLA KV pool's pages and indices): one object of
    the page's index keys, kind indexer, shared by TP ranks like the latent. SGLang keeps
    them as bytes (fp8 e4m3 keys with their scales packed after them): dtype fp8_e4m3."""
    import torch

    dtype = str(getattr(pool, "indexer_dtype", pool.dtype))
    base = base_descriptor(cfg, DType.FP8_E4M3 if dtype in _BYTE_DTYPES else kv_dtype(dtype, extra),
                           pool.page_size, namespace, extra).with_(kind=Kind.INDEXER)
    _, part_bytes = pool.get_page_buffer_meta(torch.arange(pool.page_size))
    return PagePlan.build(f"sglang:{pool.layout}:indexer", [sized(base, n) for n in part_bytes], None)


# The pools SGLang's v2 interface names (PoolName values) that kvstore carries besides KV.
SIDECAR_PLANS = {"mamba": _mamba_plan, "swa": _swa_plan, "indexer": _indexer_plan}


def sidecar_plan(pool, name, cfg, namespace: str, extra: dict, page_tokens: int) -> PagePlan:
    """The page plan of a hybrid model's extra host pool `name` (page_tokens: the KV page
    length, at whose boundaries a Mamba state is kept). Raises ValueError for a pool
    kvstore does not carry (DeepSeek V4's, draft pools): the attach fails rather than
    every prefix missing."""
    make = SIDECAR_PLANS.get(str(name))
    if make is None:
        raise ValueError(f"kvstore: SGLang's {name} host pool is not supported; kvstore carries the KV pool and "
                         f"{', '.join(SIDECAR_PLANS)} (adapters/sglang_v2.py)")
    try:
        plan = make(pool, cfg, namespace, extra, page_tokens)
    except (AssertionError, NotImplementedError, ValueError) as exc:  # the pool's own refusals too
        raise ValueError(f"kvstore: cannot carry SGLang's {name} host pool ({type(pool).__name__}, "
                         f"layout {pool.layout}): {str(exc).removeprefix('kvstore: ')}") from exc
    if plan.num_parts > MAX_GROUP_MEMBERS:
        raise ValueError(f"kvstore: a page of SGLang's {name} host pool has {plan.num_parts} parts, more than a "
                         f"store group holds ({MAX_GROUP_MEMBERS}); use --hicache-mem-layout page_first")
    return plan


_ARRAY_TYPES: dict[int, type] = {}


def host_view(ptr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 view of `nbytes` of host memory at address `ptr`, no copy. The
    memory is the host pool's: the pool outlives every backend call, and SGLang does not
    free a page while a storage operation on it is in flight."""
    array_type = _ARRAY_TYPES.get(nbytes)
    if array_type is None:
        array_type = _ARRAY_TYPES.setdefault(nbytes, ctypes.c_uint8 * nbytes)
    return np.frombuffer(array_type.from_address(ptr), dtype=np.uint8)
