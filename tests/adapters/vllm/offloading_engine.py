"""A hybrid model through vLLM's whole offloading path, with kvstore as its secondary tier
(imported by test_secondary_tier.py): vLLM's scheduler with its OffloadingConnector and
TieringOffloadingSpec, vLLM's worker connector over CPU caches, and the test as the model
runner. Only the GPU<->CPU copies of vLLM's CPUOffloadingWorker (CUDA only) are done here
with CPU copies (HostCopies).
"""

import time

import numpy as np
import torch

from tests.v1.kv_connector.unit.utils import create_scheduler, create_vllm_config
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from vllm_engine import step_until_scheduled
from vllm_model import (BLOCK, LAYER_NAMES, allocate_kv_caches, expected_kv, expected_state, mamba_config,
                        mamba_layers, plan_kv_cache, read_kv, write_kv)


NUM_BLOCKS = 64
PROMPT = 100  # steps of 64 tokens: vLLM offers the Mamba state at 64 and at 96 (the prompt's last cacheable boundary)


class HostCopies(OffloadingWorker):
    """vLLM's CPUOffloadingWorker (CUDA streams) done with CPU copies on its layout: each
    offloaded group's layer pages between the paged caches (vLLM's canonical view of them) and
    the CPU tier's chunks, each cache tensor's page at its offset in the chunk."""

    def __init__(self, caches, chunks: np.ndarray):
        self.pages = [t.tensor.numpy().view(np.uint8) for t in caches.tensors]
        self.offsets = np.cumsum([0] + [t.page_size_bytes for t in caches.tensors]).tolist()
        self.group_refs = caches.group_data_refs
        self.chunks = chunks
        self.num_loads = 0
        self.finished = []

    def _copy(self, job_id, paged, host, to_host: bool) -> bool:
        first = 0
        for refs, count in zip(self.group_refs, paged.group_sizes):
            for block, chunk in zip(paged.block_ids[first:first + count], host.block_ids[first:first + count]):
                for ref in refs:
                    at = self.offsets[ref.tensor_idx]
                    cpu = self.chunks[chunk, at:at + ref.page_size_bytes]
                    gpu = self.pages[ref.tensor_idx][block, :ref.page_size_bytes]
                    np.copyto(cpu, gpu) if to_host else np.copyto(gpu, cpu)
            first += count
        self.finished.append(TransferResult(job_id=job_id, success=True, transfer_size=None, transfer_time=None))
        return True

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id, src_spec, dst_spec, expedited=False) -> bool:
        self.num_loads += 1
        return self._copy(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self):
        finished, self.finished = self.finished, []
        return finished

    def wait(self, job_ids) -> None:
        pass

    def shutdown(self) -> None:
        pass


class OffloadingEngine:
    """vLLM's scheduler with OffloadingConnector + TieringOffloadingSpec and kvstore as the
    secondary tier (the documented config: no model or dtype given), vLLM's worker connector
    over the caches vLLM allocates, and the test as the model runner of a hybrid model
    (vllm_model.mamba_layers: attention layers 0-2, three Mamba layers). A Mamba layer's page is
    its states' bytes, conv (fp16) then SSM (fp32). A step starting at a block boundary reads the state
    there and records any difference from the model's (`state_errors`). `stored` holds each
    chunk the tier was asked to store as it was then; `promotions` the tier's load jobs."""

    def __init__(self, socket_path):
        tier = {"type": "KVStoreSecondaryTier", "module_path": "kvstore.adapters.vllm_tier", "socket_path": socket_path,
                "retry_after_s": 0.05}
        self.config = mamba_config(create_vllm_config(
            kv_connector="OffloadingConnector", kv_role="kv_both", block_size=BLOCK, max_num_batched_tokens=64,
            kv_connector_extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 48 * 4096,
                                       "secondary_tiers": [tier]}))
        self.layers = mamba_layers()
        self.kv_config = plan_kv_cache(self.config, self.layers, NUM_BLOCKS)
        self.scheduler = create_scheduler(self.config, num_blocks=NUM_BLOCKS, kv_cache_config=self.kv_config)
        self.offloading = self.scheduler.connector.connector_scheduler
        self.manager = self.offloading.manager
        self.tier = self.manager.secondary_tiers[0]
        view = self.manager.primary_tier.get_kv_memoryview()
        self.chunks = np.frombuffer(view.cast("B"), dtype=np.uint8).reshape(-1, self.tier.block_size_bytes)
        self.stored, self.promotions = {}, []
        real_store, real_load = self.tier.submit_store, self.tier.submit_load
        self.tier.submit_store = lambda job: (self.stored.update(
            (k, self.chunks[c].copy()) for k, c in zip(job.keys, job.chunk_ids)), real_store(job))[1]
        self.tier.submit_load = lambda job: (self.promotions.append(job), real_load(job))[1]
        self.worker = OffloadingConnector(self.config, KVConnectorRole.WORKER, self.kv_config)
        self.copies = None

        def host_copies(caches):
            self.copies = HostCopies(caches, self.chunks)
            return self.copies

        self.worker.connector_worker.spec.get_worker = host_copies
        self.groups = [list(group.layer_names) for group in self.kv_config.kv_cache_groups]
        self.mamba = {g: group.kv_cache_spec for g, group in enumerate(self.kv_config.kv_cache_groups)
                      if isinstance(group.kv_cache_spec, MambaSpec)}
        self.caches = allocate_kv_caches(self.config, self.kv_config, self.layers)
        with set_current_vllm_config(self.config):
            self.worker.register_kv_caches(self.caches)
        self.requests, self.tables, self.state_errors = {}, {}, []

    def add(self, request):
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def step(self):
        out = self.scheduler.schedule()
        self.worker.handle_preemptions(out.kv_connector_metadata)
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        starts.update(zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.num_computed_tokens))
        for rid, start in starts.items():
            self.tables[rid] = [list(t) for t in self.scheduler.kv_cache_manager.get_block_ids(rid)]
            self.forward(rid, start, out.num_scheduled_tokens[rid])
        self.worker.wait_for_save()
        _, received = self.worker.get_finished(out.finished_req_ids)
        worker_meta = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        ids = list(starts)
        sampled = [[0] if starts[r] + out.num_scheduled_tokens[r] >= self.requests[r].num_prompt_tokens else []
                   for r in ids]
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
            logprobs=None, prompt_logprobs_dict={}, pooler_output=None,
            kv_connector_output=KVConnectorOutput(finished_recving=received or None,
                                                  kv_connector_worker_meta=worker_meta)))
        self.tier.drain_jobs()
        return out

    def step_until_scheduled(self, request, max_steps=200):
        """Steps (the tier's lookups and promotions take a few) until `request` computes."""
        return step_until_scheduled(self, request, max_steps, pause_s=0.01)

    def run_to_end(self, max_steps=200):
        """Steps until every request is done and every store reached the store."""
        for _ in range(max_steps):
            if not (self.scheduler.has_unfinished_requests() or self.offloading.has_pending_push_work()
                    or self.manager.has_pending_work()):
                return
            self.step()
            time.sleep(0.01)
        raise AssertionError("vLLM's scheduler made no progress")

    def forward(self, rid, start, count):
        tokens = self.requests[rid].all_token_ids
        tables = self.tables[rid]
        for pos in range(start, start + count):
            for g, (names, table) in enumerate(zip(self.groups, tables)):
                for name in names if g not in self.mamba else ():
                    write_kv(self.layers[name], table[pos // BLOCK], pos % BLOCK,
                             expected_kv(tokens, pos, LAYER_NAMES.index(name)))
        for g, spec in self.mamba.items():  # through each Mamba layer's own (conv, SSM) views
            if start > 0 and start % BLOCK == 0:
                block = tables[g][start // BLOCK - 1]
                held = [view[block] for name in self.groups[g] for view in self.layers[name].kv_cache]
                want = expected_state(tokens, start, spec, self.groups[g])
                if not all(torch.equal(h, w) for h, w in zip(held, want)):
                    self.state_errors.append((rid, start))
            end = start + count
            block = tables[g][-(-end // BLOCK) - 1]
            for name, states in zip(self.groups[g], expected_state(tokens, end, spec, self.groups[g], by_layer=True)):
                for view, state in zip(self.layers[name].kv_cache, states):
                    view[block] = state

    def attention_blocks_exact(self, rid, count) -> bool:
        tokens, table = self.requests[rid].all_token_ids, self.tables[rid][0]
        return all(torch.equal(read_kv(self.layers[name], table[i])[:, slot],
                               expected_kv(tokens, i * BLOCK + slot, layer))
                   for i in range(count) for slot in range(BLOCK) for layer, name in enumerate(LAYER_NAMES))

    def shutdown(self):
        """vLLM unmaps the CPU tier's shared region only once no view of it is left."""
        self.chunks = self.copies.chunks = None
        self.worker.shutdown()
        self.scheduler.shutdown()


