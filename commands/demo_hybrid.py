"""The hybrid part of `kvstore demo`: every turn again on a hybrid model, whose state is store groups.

No small real hybrid model ships offline, so this is the reference one (`gpu.engine.hybrid`:
attention and gated delta-rule layers, seeded weights, SmolLM2's vocabulary so it reads the
same prompt token ids). Each turn's prompt runs twice: through the store and recomputing.
Through the store, each prompt chunk's attention KV and the fp32 recurrent state after it
are saved as one store group (`gpu.engine.connector_objects`), and a hit ends where such a group
is whole: its last chunk and state are read with one group read, so the engine gets KV and
state together or neither. Its replies are noise (random weights); what it shows is that the
hit tokens come back through groups, across turns, branches and a daemon restart, with
tokens identical to recomputing.
"""

from __future__ import annotations

from dataclasses import asdict

# Room for the demo's longest prompt and its reply (the default context is 4,096 tokens).
MAX_POSITION = 8192
NUM_PAGES = MAX_POSITION // 16


class HybridTurns:
    """One hybrid engine with a connector to the demo's daemon, and the same engine without."""

    def __init__(self, socket_path: str, vocab_size: int, chunk_tokens: int):
        from kvstore.gpu.engine.connector import KVConnector  # the engine (torch) only when the demo runs
        from kvstore.gpu.engine.hybrid import HybridConfig
        from kvstore.gpu.engine.hybrid_engine import HybridEngine
        self.engine = HybridEngine(HybridConfig(vocab_size=vocab_size, max_position=MAX_POSITION),
                                   num_pages=NUM_PAGES, chunk_tokens=chunk_tokens)
        self.connector = KVConnector(socket_path, self.engine.codecs(), self.engine.estimate_prefill_s)
        self.engine.generate([0] * chunk_tokens, 1)  # warm-up, neither measured nor stored

    def run(self, label: str, prompt: list[int], max_new_tokens: int) -> dict:
        """The row of one turn: hit tokens per tier, groups saved and read, TTFT, identical."""
        saved = self.connector.stats.num_saved_groups
        stored = self.engine.generate(prompt, max_new_tokens, self.connector)
        recomputed = self.engine.generate(prompt, max_new_tokens)
        hits: dict[str, int] = {}
        for tier in stored.match.tiers[:stored.loaded_tokens // self.engine.chunk_tokens]:
            hits[tier] = hits.get(tier, 0) + self.engine.chunk_tokens
        return {"turn": label, "prompt_tokens": len(prompt), "hit_tokens": hits,
                "groups_read": int(stored.loaded_tokens > 0),
                "groups_saved": self.connector.stats.num_saved_groups - saved,
                "decision": stored.match.reason, "ttft_store_ms": round(stored.ttft_s * 1e3, 1),
                "ttft_recompute_ms": round(recomputed.ttft_s * 1e3, 1),
                "identical": stored.token_ids == recomputed.token_ids}

    def report(self, rows: list[dict]) -> dict:
        c = self.engine.config
        return {"model": c.name, "revision": c.revision, "layers": list(c.pattern), "turns": rows,
                "groups_saved": self.connector.stats.num_saved_groups,
                "groups_read": self.connector.stats.num_loaded_groups,
                "connector": asdict(self.connector.stats), "store_errors": self.connector.link.num_errors}

    def close(self) -> None:
        self.connector.close()
