"""A vLLM engine for the connector tests: vLLM's real scheduler (and the connector vLLM's
factory makes), with the test as the model runner over CPU caches (imported by the tests).

Each step binds the metadata to a worker-role connector, runs start_load_kv, writes what a
model would compute for the scheduled tokens into the current block tables, runs
wait_for_save and reports back to the scheduler (load errors, and the receives a model with
several KV cache groups reports). The "model" is deterministic: the KV of position p depends
on every token up to p, the layer, K or V, the head and the dim; a Mamba layer's state after
n tokens on every token before n, the layer and the state. A step starting at token s reads
the Mamba state at s and records any difference from what the model would have computed
(`state_errors`): a state loaded from the store that is wrong, stale or missing shows.
"""

import copy
import time
from math import prod

import pytest
import torch

from tests.v1.kv_connector.unit.utils import create_request, create_scheduler, create_vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                        SlidingWindowSpec)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

BLOCK, LAYERS, HEADS, DIM, NUM_BLOCKS, CHUNK = 16, 3, 2, 8, 64, 32


@pytest.fixture(scope="module")
def base_config():
    return create_vllm_config(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.adapters.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute", block_size=BLOCK,
                              max_num_batched_tokens=64, kv_connector_extra_config={"chunk_tokens": CHUNK})


LAYER_NAMES = [f"model.layers.{i}.attn" for i in range(LAYERS)]


def kv_cache_config(num_blocks=NUM_BLOCKS):
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float16)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)])


class Engine:
    """One vLLM scheduler (its connector made by vLLM) and one worker connector over CPU caches.
    `make_kv_config` gives the KV cache groups (one, or a hybrid model's several)."""

    def __init__(self, base, socket_path, device="cpu", make_kv_config=kv_cache_config, num_blocks=NUM_BLOCKS):
        config = copy.deepcopy(base)
        config.kv_transfer_config.kv_connector_extra_config["socket_path"] = socket_path
        config.kv_transfer_config.kv_connector_extra_config["retry_after_s"] = 0.05
        kv_config = make_kv_config(num_blocks)
        self.scheduler = create_scheduler(config, num_blocks=num_blocks, kv_cache_config=kv_config)
        self.connector = self.scheduler.connector
        self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, make_kv_config(num_blocks))
        self.groups = [list(group.layer_names) for group in kv_config.kv_cache_groups]
        self.mamba = {g: group.kv_cache_spec for g, group in enumerate(kv_config.kv_cache_groups)
                      if isinstance(group.kv_cache_spec, MambaSpec)}
        self.caches = {name: torch.zeros(2, num_blocks, BLOCK, HEADS, DIM, dtype=torch.float16, device=device)
                       for name in LAYER_NAMES}
        for g, spec in self.mamba.items():
            for name in self.groups[g]:
                self.caches[name] = [torch.zeros(num_blocks, *shape, dtype=dtype, device=device)
                                     for shape, dtype in zip(spec.shapes, spec.dtypes)]
        self.worker.register_kv_caches(self.caches)
        self.requests = {}
        self.group_blocks = {}  # request id -> per group, its block table (as of its last step)
        self.load_errors = set()
        self.failed_receives = set()
        self.state_errors = []  # (request, token) where a step read another Mamba state than the model's

    @property
    def blocks(self):
        """request id -> the first group's block table."""
        return {rid: tables[0] for rid, tables in self.group_blocks.items()}

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
                    cache = self.caches[name]
                    cache[:, block, slot] = expected_kv(tokens, pos, LAYER_NAMES.index(name)).to(cache.device)
        for g, spec in self.mamba.items():
            if start > 0 and start % BLOCK == 0:
                held = self.state_at(g, tables[g][start // BLOCK - 1])
                if not all(torch.equal(h, w) for h, w in zip(held, expected_state(tokens, start, spec, self.groups[g]))):
                    self.state_errors.append((rid, start))
            end = start + count
            block = tables[g][-(-end // BLOCK) - 1]
            assert block != 0, f"vLLM gave the null block for the state at {end}"
            for name, states in zip(self.groups[g], expected_state(tokens, end, spec, self.groups[g], by_layer=True)):
                for cache, state in zip(self.caches[name], states):
                    cache[block] = state.to(cache.device)

    def state_at(self, g, block) -> list:
        """Group g's states in `block`, layer after layer, state after state."""
        return [cache[block].cpu() for name in self.groups[g] for cache in self.caches[name]]

    def block_kv(self, block, names=LAYER_NAMES):
        return torch.stack([self.caches[name][:, block].cpu() for name in names])

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


def expected_kv(tokens, pos, layer) -> torch.Tensor:
    h = 0
    for t in tokens[:pos + 1]:
        h = (h * 31 + t + 7) % 65521
    base = torch.arange(2 * HEADS * DIM, dtype=torch.float32).reshape(2, HEADS, DIM)
    return (((base + h + 13 * layer) % 251) / 8).to(torch.float16)


def tokens_of(n, seed):
    return [(seed * 7919 + i * 104729) % 50000 + 3 for i in range(n)]


def make_request(number, tokens, cache_salt=None):
    """A vLLM Request as create_request makes it, with these tokens (and cache salt)."""
    template = create_request(request_id=number, num_tokens=len(tokens), max_tokens=1, block_size=BLOCK)
    return Request(request_id=template.request_id, prompt_token_ids=list(tokens),
                   sampling_params=template.sampling_params, pooling_params=None, cache_salt=cache_salt,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def expected_blocks(tokens, count):
    return [torch.stack([torch.stack([expected_kv(tokens, index * BLOCK + s, layer) for s in range(BLOCK)], dim=1)
                         for layer in range(LAYERS)]) for index in range(count)]




WINDOW = 2 * BLOCK  # the sliding-window group's window, in tokens


def hybrid_kv_cache_config(num_blocks=NUM_BLOCKS, window=WINDOW):
    """A hybrid model: layers 0 and 2 full attention, layer 1 a sliding window."""
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float16)
    sliding = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float16,
                                sliding_window=window)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([LAYER_NAMES[0], LAYER_NAMES[2]], full), KVCacheGroupSpec([LAYER_NAMES[1]], sliding)])




def expected_state(tokens, n, spec, names, by_layer=False):
    """What the model's Mamba layers hold after the first n tokens: per layer, per state."""
    h = 0
    for t in tokens[:n]:
        h = (h * 131 + t + 3) % 65521
    layers = []
    for layer, _ in enumerate(names):
        states = []
        for i, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes)):
            base = torch.arange(prod(shape), dtype=torch.float32).reshape(shape)
            states.append((((base + h + 17 * layer + 5 * i) % 253) / 4).to(dtype))
        layers.append(states)
    return layers if by_layer else [s for states in layers for s in states]


MAMBA_NAMES = ["model.layers.3.mixer", "model.layers.4.mixer"]


def mamba_kv_cache_config(num_blocks=NUM_BLOCKS, mode="align", sliding=False, shapes=((3, 32), (2, 4, 8))):
    """A hybrid SSM model: full attention (layers 0 and 2), optionally a sliding window
    (layer 1), and two Mamba layers whose conv state is fp16 and SSM state fp32."""
    groups = hybrid_kv_cache_config(num_blocks).kv_cache_groups if sliding else [
        KVCacheGroupSpec(LAYER_NAMES, FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM,
                                                        dtype=torch.float16))]
    mamba = MambaSpec(block_size=BLOCK, shapes=shapes, dtypes=(torch.float16, torch.float32),
                      mamba_cache_mode=mode)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[*groups, KVCacheGroupSpec(MAMBA_NAMES, mamba)])


def mamba_config(base):
    """The engine config of a hybrid SSM model in vLLM's "align" mode (prefix caching on)."""
    config = copy.deepcopy(base)
    config.cache_config.mamba_cache_mode = "align"
    config.cache_config.enable_prefix_caching = True
    return config
