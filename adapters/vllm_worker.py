"""The worker role of the vLLM connector (adapters/vllm.py): bytes between vLLM's caches and
the store. Imported by adapters.vllm only once vLLM asks for the connector (it needs torch).

torch is imported where it is used: an adapter module imports without its engine's packages
(tests/test_dependency_direction.py).

Attention groups: a chunk object is every layer of the group, K and V, for the chunk's
blocks; it is staged in a host tensor shaped (layers, blocks, *block shape) and copied from or
to the paged caches with index_select / index_copy_ (pinned staging where they are on a GPU).
Mamba groups: vLLM 0.33's model runner (`allocate_kv_cache`) registers one raw page view
per Mamba layer, int8 `[num_blocks, 1, 1, C]`: a block's C bytes are the layer's states
packed in order (conv, then SSM; the layer's own `bind_kv_cache` slices them the same way),
and the block stride may be a padded page. A state object is, layer after layer, those C
bytes of one block: the `mamba(layers, states)` layout, padding never stored.

Objects of one store group (LoadSpec / SaveSpec `joint`: a chunk's attention objects and the
states at its end) are read with `get_groups_into` and put with `put_groups` (all of a step's
groups in one or two round trips): each all or nothing. Every object is put with the route
the scheduler sent for it (SaveSpec.route: vLLM's block hashes of its blocks), so the
daemon's KV events name it as vLLM's own events name those blocks.
A load that fails is reported as vLLM asks: block ids (`get_block_ids_with_load_errors`) for
a single-group model, a failed receive of the whole request (`get_transfer_results`) for a
model with several groups.
"""

from __future__ import annotations

import logging

from kvstore.groups import Member
from kvstore.adapters.vllm_plan import LoadSpec, SaveSpec

log = logging.getLogger("kvstore.adapters.vllm")
STAGED_CHUNKS = 32  # pinned staging chunks kept per KV cache group when the cache is on a GPU


def _u8(tensor):
    """A tensor's bytes as a flat uint8 numpy array (no copy)."""
    import torch
    return tensor.view(-1).view(torch.uint8).numpy()


def _state_bytes(page, block: int):
    """Block `block` of a Mamba layer's raw page view: its states' bytes, a flat uint8 view
    (the padding past them is not part of it)."""
    import torch
    return page[block].view(-1).view(torch.uint8)


class WorkerIO:
    """Mixed into KVStoreConnector; uses its groups, store, block size and chunk size."""

    def register_kv_caches(self, kv_caches: dict):
        missing = [name for names in self._layer_names for name in names if name not in kv_caches]
        if missing:
            raise ValueError(f"kvstore: vLLM registered no KV cache for layers {missing[:4]}")
        self._layers = [[kv_caches[name] for name in names] for names in self._layer_names]
        first = self._layers[self._attention[0]][0]
        # vLLM's paged caches are (2, num_blocks, ...) or (num_blocks, ...) (MLA).
        self._block_dim = 1 if first.dim() > 1 and first.shape[1] == self.num_blocks else 0
        for g, ((desc, _, kind), layers) in enumerate(zip(self.groups, self._layers)):
            if kind == "mamba":
                self._check_states(g, desc, layers)
                continue
            if layers[0].shape[self._block_dim] != self.num_blocks:
                raise ValueError(f"kvstore: no dimension of size num_blocks={self.num_blocks} in the KV cache "
                                 f"of shape {tuple(layers[0].shape)}")
            per_block = layers[0].select(self._block_dim, 0).numel() * layers[0].element_size()
            actual = per_block * len(layers) * (self.chunk_tokens // self.block_size)
            if desc.object_bytes and desc.object_bytes != actual:
                raise ValueError(f"kvstore: the KV cache holds {actual} bytes per chunk, its descriptor "
                                 f"{desc.layout} says {desc.object_bytes}")

    def _check_states(self, g: int, desc, layers) -> None:
        """Each Mamba layer is the raw page view vLLM's allocate_kv_cache makes: int8
        [num_blocks, 1, 1, C], C bytes of states per block; the group's object is every layer's."""
        import torch
        content = desc.object_bytes // len(layers)
        for page in layers:
            if (isinstance(page, torch.Tensor) and page.shape[:1] == (self.num_blocks,) and page[0].squeeze().dim() <= 1
                    and page[0].numel() * page.element_size() == content and page.stride(-1) == 1):
                continue
            got = type(page).__name__ + (f" {tuple(page.shape)}" if isinstance(page, torch.Tensor) else "")
            raise ValueError(f"kvstore: group {g}'s Mamba caches must be vLLM 0.33's raw page views, one tensor per "
                             f"layer shaped [num_blocks={self.num_blocks}, 1, 1, {content}] (the layer's states, "
                             f"{content} bytes a block), got {got}. Register the caches vLLM's model runner allocates "
                             "(vllm.v1.worker.utils.allocate_kv_cache) as they are")

    # --- buffers ---------------------------------------------------------------------------

    def _staging(self, specs) -> list:
        """One host tensor per object of `specs`: a Mamba state's bytes, or an attention chunk
        in its group's shape. Where the cache is on a GPU chunks are pinned (copies by DMA) and
        kept for the next steps, up to STAGED_CHUNKS per group; beyond that, and on CPU, they
        are made per step."""
        import torch
        taken: dict[int, int] = {}
        out = []
        for spec in specs:
            desc, _, kind = self.groups[spec.group]
            if kind == "mamba":
                out.append(torch.empty(desc.object_bytes, dtype=torch.uint8))
                continue
            first = self._layers[spec.group][0]
            shape = (len(self._layers[spec.group]), self.chunk_tokens // self.block_size,
                     *first.select(self._block_dim, 0).shape)
            if not first.is_cuda:
                out.append(torch.empty(shape, dtype=first.dtype))
                continue
            pool = self._pinned.setdefault(spec.group, [])
            index = taken[spec.group] = taken.get(spec.group, -1) + 1
            if index < len(pool):
                out.append(pool[index])
            elif index < STAGED_CHUNKS:
                pool.append(torch.empty(shape, dtype=first.dtype, pin_memory=True))
                out.append(pool[index])
            else:
                out.append(torch.empty(shape, dtype=first.dtype))
        return out

    # --- loads -----------------------------------------------------------------------------

    def start_load_kv(self, forward_context, **kwargs):
        """Each store group in one group read first, then the objects read alone in one
        pipelined get (none for a request whose group failed: its load has failed whole);
        each into its blocks."""
        loads = self._get_connector_metadata().loads
        if not loads:
            return
        joint: dict[tuple[str, int], list[LoadSpec]] = {}
        for spec in loads:
            if spec.joint is not None:
                joint.setdefault((spec.request_id, spec.joint), []).append(spec)
        reads = [(specs, self._staging(specs)) for specs in joint.values()]
        got = self.store.get_groups_into([([Member(spec.object_id, self.groups[spec.group][0]) for spec in specs],
                                           [_u8(b) for b in bufs]) for specs, bufs in reads])
        for (specs, bufs), ok in zip(reads, got):
            self._place(specs, bufs, ok)
        alone = [spec for spec in loads if spec.joint is None and spec.request_id not in self._failed]
        chunks = self._staging(alone)
        got = self.store.get_many_into([(spec.object_id, _u8(chunk)) for spec, chunk in zip(alone, chunks)])
        for spec, chunk, ok in zip(alone, chunks, got):
            self._place([spec], [chunk], ok)
        if self._load_async:
            self._received |= {spec.request_id for spec in loads}

    def _place(self, specs: list[LoadSpec], bufs: list, ok: bool) -> None:
        """Write read objects into vLLM's blocks; a miss or a failure is reported as vLLM asks."""
        try:
            if ok:
                for spec, buf in zip(specs, bufs):
                    self._scatter(spec, buf)
                return
        except Exception:
            log.exception("kvstore: loading %s failed; vLLM recomputes it", specs[0].object_id)
        if self._load_async:
            self._failed.update(spec.request_id for spec in specs)
        else:
            self._load_errors.update(block for spec in specs for _, block in spec.blocks)

    def _scatter(self, spec: LoadSpec, buf) -> None:
        import torch
        if self.groups[spec.group][2] == "mamba":
            block, at = spec.blocks[0][1], 0
            for page in self._layers[spec.group]:
                row = _state_bytes(page, block)
                row.copy_(buf[at:at + row.numel()].to(row.device))
                at += row.numel()
            self.num_loaded_states += 1
            return
        if not spec.blocks:
            return  # read only to complete its store group (a sliding window holds none of its blocks)
        inside = torch.tensor([i for i, _ in spec.blocks])
        dest = torch.tensor([b for _, b in spec.blocks])
        for layer, cache in enumerate(self._layers[spec.group]):
            picked = buf[layer].index_select(0, inside).to(cache.device)
            cache.index_copy_(self._block_dim, dest.to(cache.device), picked.movedim(0, self._block_dim))
        self.num_loaded_chunks += 1

    def wait_for_layer_load(self, layer_name: str):
        return  # loads are synchronous: complete when start_load_kv returns

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_transfer_results(self, finished_req_ids: set[str]):
        """The requests whose load ran this step (async loads), and those of them that failed."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
        received, failed = self._received, self._failed
        self._received, self._failed = set(), set()
        return KVConnectorTransferResults(finished_recving=received | failed, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]):
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving or None

    # --- saves -----------------------------------------------------------------------------

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return  # chunks are saved whole, once every layer ran (wait_for_save)

    def wait_for_save(self):
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        per_group: dict[int, list] = {}
        joint: dict[tuple[str, int], list] = {}
        for spec, buf in zip(meta.saves, self._staging(meta.saves)):
            try:
                self._gather(spec, buf)
            except Exception:
                log.exception("kvstore: reading %s out of vLLM's cache failed", spec.object_id)
                if spec.joint is not None:
                    joint[(spec.request_id, spec.joint)] = None  # the group cannot be whole: not put
                continue
            if spec.joint is None:
                per_group.setdefault(spec.group, []).append((spec.object_id, _u8(buf), spec.route))
            elif (items := joint.setdefault((spec.request_id, spec.joint), [])) is not None:
                items.append((spec.object_id, _u8(buf), self.groups[spec.group][0], spec.route))
        for group, items in per_group.items():  # each object with its route (vLLM's names for its blocks)
            self.num_saved_chunks += sum(self.store.put_many([(oid, data) for oid, data, _ in items],
                                                             self.groups[group][0], [r for *_, r in items]))
        groups = [items for items in joint.values() if items]
        stored = self.store.put_groups([[item[:3] for item in items] for items in groups],
                                       routes=[[r for *_, r in items] for items in groups])
        for items, ok in zip(groups, stored):
            if ok:
                self.num_saved_groups += 1
                self.num_saved_chunks += sum(1 for _, _, desc, _ in items if desc.layout.name != "mamba")

    def _gather(self, spec: SaveSpec, buf) -> None:
        import torch
        if self.groups[spec.group][2] == "mamba":
            block, at = spec.block_ids[0], 0
            for page in self._layers[spec.group]:
                row = _state_bytes(page, block)
                buf[at:at + row.numel()].copy_(row.cpu())
                at += row.numel()
            return
        for layer, cache in enumerate(self._layers[spec.group]):
            index = torch.tensor(spec.block_ids, device=cache.device)
            buf[layer].copy_(cache.index_select(self._block_dim, index).movedim(self._block_dim, 0))
