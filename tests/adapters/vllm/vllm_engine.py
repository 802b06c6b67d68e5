"""A vLLM engine for the connector tests: vLLM's real scheduler (and the connector vLLM's
factory makes), with the test as the model runner over CPU caches (imported by the tests).

The caches are the model's (vllm_model): planned, allocated and bound by vLLM's own code, and
registered with the worker connector as vLLM's model runner registers them. Each step binds
the metadata to a worker-role connector, runs start_load_kv, writes what the model computes
for the scheduled tokens into the current block tables (through each layer's bound view, as
a real layer does), runs wait_for_save and reports back to the scheduler (load errors, and
the receives a model with several KV cache groups reports). A step starting at token s
reads the Mamba state at s and records any difference from what the model would have
computed (`state_errors`): a state loaded from the store that is wrong, stale or missing shows.
"""

import copy
import time

import pytest
import torch

from tests.v1.kv_connector.unit.utils import create_request, create_scheduler, create_vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from vllm_model import (BLOCK, LAYER_NAMES, allocate_kv_caches, attention_layers, expected_kv, expected_state,
                        plan_kv_cache, read_kv, write_kv)

NUM_BLOCKS, CHUNK = 64, 32


@pytest.fixture(scope="module")
def base_config():
    return create_vllm_config(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.adapters.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute", block_size=BLOCK,
                              max_num_batched_tokens=64, kv_connector_extra_config={"chunk_tokens": CHUNK})


class Engine:
    """One vLLM scheduler (its connector made by vLLM) and one worker connector over the
    caches vLLM allocates for the model `make_layers()` gives (vllm_model: attention only, a
    hybrid model's several groups, Mamba layers), on `device`."""

    def __init__(self, base, socket_path, device="cpu", make_layers=attention_layers, num_blocks=NUM_BLOCKS):
        config = copy.deepcopy(base)
        config.kv_transfer_config.kv_connector_extra_config["socket_path"] = socket_path
        config.kv_transfer_config.kv_connector_extra_config["retry_after_s"] = 0.05
        self.config, self.layers = config, make_layers()
        self.kv_config = kv_config = plan_kv_cache(config, self.layers, num_blocks)
        self.scheduler = create_scheduler(config, num_blocks=num_blocks, kv_cache_config=kv_config)
        self.connector = self.scheduler.connector
        worker_config = copy.deepcopy(kv_config)  # vLLM's worker holds a copy of its own
        self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, worker_config)
        self.groups = [list(group.layer_names) for group in kv_config.kv_cache_groups]
        self.group_of = {name: g for g, names in enumerate(self.groups) for name in names}
        self.mamba = {g: group.kv_cache_spec for g, group in enumerate(kv_config.kv_cache_groups)
                      if isinstance(group.kv_cache_spec, MambaSpec)}
        self.registered = allocate_kv_caches(config, worker_config, self.layers, device)
        self.worker.register_kv_caches(self.registered)
        self.requests = {}
        self.group_blocks = {}  # request id -> per group, its block table (as of its last step)
        self.load_errors = set()
        self.failed_receives = set()
        self.state_errors = []  # (request, token) where a step read another Mamba state than the model's

    def add(self, request):
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def step(self):
        out = self.scheduler.schedule()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        scheduled = [(new.req_id, new.num_computed_tokens) for new in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        scheduled += list(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, computed in scheduled:
            self.group_blocks[rid] = [list(t) for t in self.scheduler.kv_cache_manager.get_block_ids(rid)]
            self.forward(rid, computed, out.num_scheduled_tokens[rid])
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        errors = self.worker.get_block_ids_with_load_errors()
        self.load_errors |= errors
        results = self.worker.get_transfer_results(set())
        self.failed_receives |= results.failed_recving
        self.scheduler.update_from_output(out, self.runner_output(out, errors, results))
        return out

    def step_until_scheduled(self, request, max_steps=5):
        """Steps until `request` computes (a hybrid model's load takes a step of its own)."""
        return step_until_scheduled(self, request, max_steps)

    def runner_output(self, out, errors, results):
        """What a model runner reports: a sampled token only for requests whose prompt is done,
        and the connector's load errors and receives."""
        ids = list(out.num_scheduled_tokens)
        computed = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        computed.update(zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.num_computed_tokens))
        sampled = [[0] if computed[r] + out.num_scheduled_tokens[r] >= self.requests[r].num_prompt_tokens else []
                   for r in ids]
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                 pooler_output=None,
                                 kv_connector_output=KVConnectorOutput(
                                     finished_recving=results.finished_recving or None,
                                     failed_recving=results.failed_recving, invalid_block_ids=errors))

    def forward(self, rid, start, count):
        """Compute positions [start, start + count): every attention group's KV, and each Mamba
        group's state after the last of them (read first: the state at `start`)."""
        tokens = self.requests[rid].all_token_ids
        tables = self.group_blocks[rid]
        for pos in range(start, start + count):
            for g, (names, table) in enumerate(zip(self.groups, tables)):
                if g in self.mamba:
                    continue
                block, slot = table[pos // BLOCK], pos % BLOCK
                assert block != 0, f"vLLM gave the null block for computed position {pos}"
                for name in names:
                    write_kv(self.layers[name], block, slot, expected_kv(tokens, pos, LAYER_NAMES.index(name)))
        for g, spec in self.mamba.items():
            if start > 0 and start % BLOCK == 0:
                held = self.state_at(g, tables[g][start // BLOCK - 1])
                want = expected_state(tokens, start, spec, self.groups[g])
                if not all(torch.equal(h, w) for h, w in zip(held, want)):
                    self.state_errors.append((rid, start))
            end = start + count
            block = tables[g][-(-end // BLOCK) - 1]
            assert block != 0, f"vLLM gave the null block for the state at {end}"
            for name, states in zip(self.groups[g], expected_state(tokens, end, spec, self.groups[g], by_layer=True)):
                for view, state in zip(self.layers[name].kv_cache, states):  # vLLM's (conv, SSM) views of the page
                    view[block] = state.to(view.device)

    def state_at(self, g, block) -> list:
        """Group g's states in `block`, layer after layer, state after state (through each Mamba
        layer's own views)."""
        return [view[block].cpu() for name in self.groups[g] for view in self.layers[name].kv_cache]

    def block_of(self, rid, name, index) -> int:
        """The block that holds block `index` of request `rid` in layer `name` (0: none)."""
        return self.group_blocks[rid][self.group_of[name]][index]

    def block_kv(self, rid, index, names=LAYER_NAMES):
        """Block `index` of request `rid` in attention layers `names`: (layers, 2, BLOCK, heads,
        dim), as expected_blocks gives it."""
        return torch.stack([read_kv(self.layers[name], self.block_of(rid, name, index)) for name in names])

    def run_to_end(self, max_steps=500):
        outs = []
        while self.scheduler.has_unfinished_requests():
            assert len(outs) < max_steps, "vLLM's scheduler made no progress"
            outs.append(self.step())
        return outs


def step_until_scheduled(engine, request, max_steps: int, pause_s: float = 0.0):
    """engine.step() until `request` computes this step (its scheduler output), pausing
    `pause_s` between steps; AssertionError after `max_steps`."""
    for _ in range(max_steps):
        out = engine.step()
        if request.request_id in out.num_scheduled_tokens:
            return out
        time.sleep(pause_s)
    raise AssertionError(f"{request.request_id} was not scheduled in {max_steps} steps")


def tokens_of(n, seed):
    return [(seed * 7919 + i * 104729) % 50000 + 3 for i in range(n)]


def make_request(number, tokens, cache_salt=None):
    """A vLLM Request as create_request makes it, with these tokens (and cache salt)."""
    template = create_request(request_id=number, num_tokens=len(tokens), max_tokens=1, block_size=BLOCK)
    return Request(request_id=template.request_id, prompt_token_ids=list(tokens),
                   sampling_params=template.sampling_params, pooling_params=None, cache_salt=cache_salt,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))
