"""The test engines' model as vLLM's model runner sees it (imported by vllm_engine.py and
offloading_engine.py): layers that state their KV cache spec, with their caches planned,
allocated and bound by vLLM's own code, so a connector is handed exactly what a vLLM 0.33
worker registers (issue 41: hand-made caches had drifted from vLLM's).

    layers      name -> Attention (its spec) or Mixer (vLLM's MambaBase: vLLM makes its spec)
    plan        vLLM's get_kv_cache_groups + get_kv_cache_config_from_groups: the grouping,
                the Mamba page padded to the attention page, every layer's strides
    allocate    vLLM's GPUModelRunner.initialize_kv_cache_tensors (allocate_kv_cache, then
                bind_kv_cache): one view per layer, attention [num_blocks, heads, block,
                K|V], a Mamba layer's raw int8 page [num_blocks, 1, 1, C]; each layer
                bound as vLLM binds it (a Mixer's kv_cache: vLLM's own (conv, SSM) views)

What the model computes is deterministic: the KV of position p depends on every token up to
p, the layer, K or V, the head and the dim; a Mamba layer's state after n tokens on every
token before n, the layer and the state.
"""

import copy
from math import prod
from types import SimpleNamespace

import torch

from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

BLOCK, LAYERS, HEADS, DIM = 16, 3, 2, 8
WINDOW = 2 * BLOCK  # the sliding window of the hybrid models, in tokens
LAYER_NAMES = [f"model.layers.{i}.attn" for i in range(LAYERS)]
MAMBA_NAMES = [f"model.layers.{i}.mixer" for i in range(LAYERS, 2 * LAYERS)]
STATE_SHAPES = ((3, 32), (2, 4, 8))  # conv, SSM
STATE_DTYPES = (torch.float16, torch.float32)


class Attention(AttentionLayerBase):
    """An attention layer: its spec; bound, it holds vLLM's view of its cache (`kv_cache`)."""

    def __init__(self, spec):
        self.spec = spec

    def get_kv_cache_spec(self, vllm_config):
        return self.spec

    def get_attn_backend(self):
        raise NotImplementedError("the test model runs no attention kernel")


class Mixer(MambaBase):
    """A Mamba layer: vLLM's MambaBase makes its spec from the config (get_kv_cache_spec) and
    unpacks its raw page into per-state views when bound (bind_kv_cache), as in a real model."""

    def __init__(self, shapes=STATE_SHAPES, dtypes=STATE_DTYPES):
        self.shapes, self.dtypes = tuple(shapes), tuple(dtypes)

    def get_state_shape(self):
        return self.shapes

    def get_state_dtype(self):
        return self.dtypes

    @property
    def mamba_type(self):
        return MambaAttentionBackendEnum.MAMBA2


def full_spec():
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float16)


def attention_layers() -> dict:
    return {name: Attention(full_spec()) for name in LAYER_NAMES}


def hybrid_layers(window=WINDOW) -> dict:
    """Layers 0 and 2 full attention, layer 1 a sliding window (vLLM puts each in a group)."""
    sliding = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float16,
                                sliding_window=window)
    return {name: Attention(sliding if i == 1 else full_spec()) for i, name in enumerate(LAYER_NAMES)}


def mamba_layers(sliding=False, shapes=STATE_SHAPES, dtypes=STATE_DTYPES) -> dict:
    """A hybrid SSM model: the attention layers (with a sliding window: `hybrid_layers`) and
    three Mamba layers. Without the window vLLM makes two groups, attention and Mamba; with
    it, one group per layer."""
    attention = hybrid_layers() if sliding else attention_layers()
    return {**attention, **{name: Mixer(shapes, dtypes) for name in MAMBA_NAMES}}


def mamba_config(base, retention_tokens: int | None = 2 * BLOCK):
    """The engine config of a hybrid SSM model in vLLM's "align" mode (prefix caching on),
    retaining a Mamba state every `retention_tokens` (--prefix-cache-retention-interval; vLLM's
    default, 0, keeps only the prompt's last cacheable state and shared-prefix junctions), so a
    100-token prompt leaves states at 64 and 96 (where its 64-token steps end)."""
    config = copy.deepcopy(base)
    config.cache_config.mamba_cache_mode = "align"
    config.cache_config.enable_prefix_caching = True
    config.cache_config.mamba_block_size = config.cache_config.block_size  # as vLLM's platform sets it in align mode
    config.cache_config.prefix_cache_retention_interval = retention_tokens
    return config


def plan_kv_cache(config, layers: dict, num_blocks: int) -> KVCacheConfig:
    """vLLM's KV cache config for `layers`, `num_blocks` blocks (its block-count override)."""
    planning = copy.deepcopy(config)
    planning.cache_config.num_gpu_blocks_override = num_blocks
    specs = {name: layer.get_kv_cache_spec(config) for name, layer in layers.items()}
    return get_kv_cache_config_from_groups(planning, get_kv_cache_groups(planning, specs), available_memory=0)


def allocate_kv_caches(config, kv_config: KVCacheConfig, layers: dict, device="cpu") -> dict:
    """What a vLLM 0.33 worker registers with its KV connector: the model runner's own
    initialize_kv_cache_tensors (no kernel-block split), which also binds `layers`."""
    runner = SimpleNamespace(device=torch.device(device), cache_config=config.cache_config, shared_kv_cache_layers={},
                             model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="test")),
                             compilation_config=SimpleNamespace(static_forward_context=layers), kv_caches=[],
                             attn_groups=[], speculative_config=None)
    block_sizes = [group.kv_cache_spec.block_size for group in kv_config.kv_cache_groups]
    return GPUModelRunner.initialize_kv_cache_tensors(runner, kv_config, block_sizes)


def write_kv(layer: Attention, block: int, slot: int, kv) -> None:
    """Position `slot` of `block`: kv (2, heads, dim) into vLLM's [block, head, slot, K|V]."""
    layer.kv_cache[block, :, slot] = kv.permute(1, 0, 2).reshape(HEADS, 2 * DIM).to(layer.kv_cache.device)


def read_kv(layer: Attention, block: int):
    """`block` of the layer as expected_blocks gives it: (2, BLOCK, heads, dim)."""
    return layer.kv_cache[block].cpu().unflatten(-1, (2, DIM)).permute(2, 1, 0, 3)


def expected_kv(tokens, pos, layer) -> torch.Tensor:
    h = 0
    for t in tokens[:pos + 1]:
        h = (h * 31 + t + 7) % 65521
    base = torch.arange(2 * HEADS * DIM, dtype=torch.float32).reshape(2, HEADS, DIM)
    return (((base + h + 13 * layer) % 251) / 8).to(torch.float16)


def expected_blocks(tokens, count):
    """Per block, (layers, 2, BLOCK, heads, dim)."""
    return [torch.stack([torch.stack([expected_kv(tokens, index * BLOCK + s, layer) for s in range(BLOCK)], dim=1)
                         for layer in range(LAYERS)]) for index in range(count)]


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
