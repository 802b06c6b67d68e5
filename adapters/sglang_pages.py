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
into the engine tag because the same bytes are ordered differently per layout.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from kvstore.dtypes import DType
from kvstore.identity import Kind, ObjectId, Shard, StateDescriptor
from kvstore.layout import Layout
from adapters.common import engine_object_id

_DTYPES = {"torch.bfloat16": DType.BF16, "torch.float16": DType.FP16, "torch.float32": DType.FP32,
           "torch.float8_e4m3fn": DType.FP8_E4M3, "torch.float8_e5m2": DType.FP8_E5M2}
# Pools that keep fp8 as raw bytes do not say which fp8: the extra config must.
_BYTE_DTYPES = {"torch.uint8", "torch.int8"}


def storage_shard(cfg) -> Shard:
    """The slice of the model's KV state this rank holds, flattened to one index/count:
    pipeline stage, then TP rank (MHA only: an MLA latent is the same on every TP rank, so
    all of them share one object), then the decode-context and attention-context ranks
    (each holds a disjoint slice of every page)."""
    axes = [(cfg.pp_rank, cfg.pp_size)]
    if not cfg.is_mla_model:
        axes.append((cfg.tp_rank, cfg.tp_size))
    axes += [(cfg.dcp_rank, cfg.dcp_size), (cfg.attn_cp_rank, cfg.attn_cp_size)]
    index, count = 0, 1
    for rank, size in axes:
        index, count = index * size + rank, count * size
    return Shard(index, count)


def base_descriptor(cfg, pool_dtype: str, page_tokens: int, namespace: str, extra: dict) -> StateDescriptor:
    """Everything of a part's descriptor but its size. Raises ValueError naming the extra
    config key to set when SGLang's config does not say enough."""
    model = cfg.model_name or extra.get("model")
    if not model:
        raise ValueError('kvstore: SGLang passed no model name; set "model" in '
                         "--hicache-storage-backend-extra-config")
    if pool_dtype in _BYTE_DTYPES:
        if "kv_cache_dtype" not in extra:
            raise ValueError(f"kvstore: the host pool keeps its KV cache as {pool_dtype}; say which fp8 it "
                             'holds with "kv_cache_dtype" ("fp8_e4m3" or "fp8_e5m2") in '
                             "--hicache-storage-backend-extra-config")
        dtype = DType.parse(extra["kv_cache_dtype"])
    elif pool_dtype in _DTYPES:
        dtype = _DTYPES[pool_dtype]
    else:
        raise ValueError(f"kvstore: a host pool of {pool_dtype} is not a KV dtype kvstore stores "
                         f"({', '.join(sorted(_DTYPES))})")
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
    page, as SGLang's older get/set interface moves it."""

    engine: str
    page_tokens: int
    part_bytes: tuple[int, ...]
    part_descs: tuple[StateDescriptor, ...]
    groups: tuple[tuple[StateDescriptor, tuple[int, ...]], ...]
    page_desc: StateDescriptor

    @classmethod
    def build(cls, base: StateDescriptor, layout: str, part_bytes, page_bytes: int) -> PagePlan:
        part_descs = tuple(sized(base, n) for n in part_bytes)
        groups: dict[StateDescriptor, list[int]] = {}
        for j, desc in enumerate(part_descs):
            groups.setdefault(desc, []).append(j)
        return cls(f"sglang:{layout}", base.chunk_tokens, tuple(part_bytes), part_descs,
                   tuple((d, tuple(js)) for d, js in groups.items()), sized(base, page_bytes))

    @property
    def num_parts(self) -> int:
        return len(self.part_bytes)

    def part_ids(self, key: str) -> list[ObjectId]:
        return [engine_object_id(desc, self.engine, f"{key}#{j}") for j, desc in enumerate(self.part_descs)]

    def page_id(self, key: str) -> ObjectId:
        return engine_object_id(self.page_desc, self.engine, f"{key}#page")

    def leading_pages(self, found: list[bool], parts: int) -> int:
        """How many leading pages have all `parts` of their objects in `found`."""
        for page in range(len(found) // parts):
            if not all(found[page * parts:(page + 1) * parts]):
                return page
        return len(found) // parts


_ARRAY_TYPES: dict[int, type] = {}


def host_view(ptr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 view of `nbytes` of host memory at address `ptr`, no copy. The
    memory is the host pool's: the pool outlives every backend call, and SGLang does not
    free a page while a storage operation on it is in flight."""
    array_type = _ARRAY_TYPES.get(nbytes)
    if array_type is None:
        array_type = _ARRAY_TYPES.setdefault(nbytes, ctypes.c_uint8 * nbytes)
    return np.frombuffer(array_type.from_address(ptr), dtype=np.uint8)
