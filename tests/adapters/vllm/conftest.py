"""vLLM's own test utilities, on CPU, with no model weights (issue 12).

Runs in the vLLM environment only (scripts/test_engines.sh vllm): there `vllm` imports and
vLLM's sdist tests/ (create_vllm_config, create_scheduler, create_request) lie under
<env>/src. A stub Hugging Face cache holds a config.json for facebook/opt-125m, which is all
vLLM's ModelConfig reads with HF_HUB_OFFLINE=1.
"""

import json
import os
import pathlib
import sys
import tempfile

import pytest

# A submodule: in another environment, `import vllm` can find this very folder (a namespace package).
pytest.importorskip("vllm.v1.kv_cache_interface", reason="runs in the vllm environment: scripts/test_engines.sh vllm")

OPT_125M = {"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768,
            "num_attention_heads": 12, "num_hidden_layers": 12, "ffn_dim": 3072,
            "max_position_embeddings": 2048, "vocab_size": 50272, "word_embed_proj_dim": 768,
            "torch_dtype": "float16", "do_layer_norm_before": True, "pad_token_id": 1, "bos_token_id": 2,
            "eos_token_id": 2, "activation_function": "relu", "enable_bias": True}


def _stub_hf_home() -> str:
    root = pathlib.Path(tempfile.mkdtemp(prefix="kvs-hf-"))
    repo = root / "hub" / "models--facebook--opt-125m"
    revision = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(OPT_125M))
    return str(root)


os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = _stub_hf_home()
_SDIST = pathlib.Path(sys.prefix) / "src"
if not (_SDIST / "tests" / "v1" / "kv_connector" / "unit" / "utils.py").exists():
    pytest.exit(f"vLLM's test utilities are missing under {_SDIST}: rerun scripts/engine_env.sh vllm", 2)
sys.path.append(str(_SDIST))
