import json, os, pathlib, sys, tempfile
root = pathlib.Path(tempfile.mkdtemp(prefix="hf-"))
repo = root / "hub" / "models--facebook--opt-125m"; rev = "0" * 40
(repo / "refs").mkdir(parents=True); (repo / "refs" / "main").write_text(rev)
snap = repo / "snapshots" / rev; snap.mkdir(parents=True)
(snap / "config.json").write_text(json.dumps({"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768,
  "num_attention_heads": 12, "num_hidden_layers": 12, "ffn_dim": 3072, "max_position_embeddings": 2048, "vocab_size": 50272,
  "word_embed_proj_dim": 768, "torch_dtype": "float16", "do_layer_norm_before": True, "pad_token_id": 1, "bos_token_id": 2,
  "eos_token_id": 2, "activation_function": "relu", "enable_bias": True}))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu"); os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["HF_HOME"] = str(root)
sys.path[:0] = [str(pathlib.Path(__file__).resolve().parent), sys.prefix + "/src"]
import torch
from dataclasses import replace
from tests.v1.kv_connector.unit.utils import create_vllm_config, create_scheduler, create_request, make_kv_cache_config, create_model_runner_output
from vllm.v1.kv_cache_interface import MambaSpec
import vllm_probe_connector as hyb_conn
from vllm.v1.outputs import ModelRunnerOutput
B = 16
for swa, hit in ((False, 64), (True, 64), (False, 48)):
    hyb_conn.ProbeConnector.HIT = hit
    hyb_conn.LOG.clear()
    cfg = create_vllm_config(kv_connector="ProbeConnector", kv_connector_module_path="vllm_probe_connector", kv_role="kv_both",
                             block_size=B, max_num_batched_tokens=32)
    cfg.cache_config.mamba_cache_mode = "align"
    print("HMA disabled?", cfg.scheduler_config.disable_hybrid_kv_cache_manager)
    kvc = make_kv_cache_config(B, swa_enabled=swa, mamba_enabled=True, mamba_cache_mode="align", num_blocks=200, sw_size=32)
    g = kvc.kv_cache_groups[-1]
    g.kv_cache_spec = replace(g.kv_cache_spec, shapes=((3, 32), (2, 4, 8)), dtypes=(torch.float16, torch.float32))
    print("groups", [type(x.kv_cache_spec).__name__ for x in kvc.kv_cache_groups], "mamba page", g.kv_cache_spec.page_size_bytes, "hit", hit)
    s = create_scheduler(cfg, num_blocks=200, kv_cache_config=kvc, hash_block_size=B)
    r = create_request(request_id=1 + swa, num_tokens=75, max_tokens=2, block_size=B)
    s.add_request(r)
    for step in range(8):
        if not s.has_unfinished_requests(): break
        out = s.schedule()
        done = r.num_computed_tokens >= r.num_prompt_tokens
        s.update_from_output(out, ModelRunnerOutput(req_ids=[r.request_id], req_id_to_index={r.request_id: 0},
                             sampled_token_ids=[[5] if done else []]))
    for e in hyb_conn.LOG: print(e)
