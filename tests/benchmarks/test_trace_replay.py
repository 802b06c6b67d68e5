"""bench/trace_replay.py on a small generated agent trace (CI runs it; the figures in the
README come from a larger run): the trace format, the generator's shape, and a replay through
a real daemon whose every hit is read back and checked."""

import json
import subprocess
import sys

import pytest

from bench import trace_replay as tr


def test_a_mooncake_trace_file_loads_sorted_and_a_bad_line_is_named(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}\n\n'
                    '{"timestamp": 1, "input_length": 100, "output_length": 9, "hash_ids": [1]}\n')
    trace = tr.load_trace(str(path))
    assert [r["hash_ids"] for r in trace] == [[1], [1, 2]] and trace[1]["input_length"] == 600
    path.write_text('{"timestamp": 1, "hash_ids": [1]}\n{"timestamp": 2, "hash_ids": "x"}\n')
    with pytest.raises(SystemExit, match=r"t.jsonl:2: not a Mooncake trace line"):
        tr.load_trace(str(path))


def test_the_generated_agent_trace_shares_prefixes_branches_and_retries():
    trace = tr.agent_trace(400, seed=3)
    assert len(trace) == 400 and trace == sorted(trace, key=lambda r: r["timestamp"])
    assert trace == tr.agent_trace(400, seed=3), "a seed gives the same trace"
    firsts = {tuple(r["hash_ids"][:2]) for r in trace}
    assert len(firsts) <= 4 * 6, "every session starts with one of the shared system prompts and tools"
    retries = sum(a["hash_ids"] == b["hash_ids"] for a, b in zip(trace, trace[1:]))
    assert retries > 0
    assert all(0 < r["input_length"] <= len(r["hash_ids"]) * tr.BLOCK_TOKENS for r in trace)


def test_a_replay_through_a_daemon_hits_shared_prefixes_and_reads_back_every_block(daemon):
    trace = tr.agent_trace(150, seed=5)
    side = tr.KVStoreSide(daemon.socket, 4096)
    try:
        result = tr.replay(side, trace, 4096)
    finally:
        side.close()
    assert result["requests"] == 150 and result["wrong_blocks"] == 0 and result["failed_writes"] == 0
    assert 0.3 < result["block_hit_rate"] < 1.0, result  # shared prompts and growing contexts hit, new turns miss
    assert result["bytes_read_per_hit_token"] == pytest.approx(4096 / tr.BLOCK_TOKENS, rel=0.2)


def test_the_command_replays_a_generated_trace_and_writes_its_results(tmp_path):
    saved = tmp_path / "agent.jsonl"
    done = subprocess.run([sys.executable, "bench/trace_replay.py", "--generate", "agent", "--requests", "80",
                           "--stores", "kvstore", "--policies", "lru", "--block-kb", "4", "--capacity-mb", "8",
                           "--write-trace", str(saved),
                           "--results", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "block_hit_rate" in done.stdout and len(saved.read_text().splitlines()) == 80
    results = json.load(open(tmp_path / "r.json"))
    assert results["results"]["kvstore"]["requests"] == 80
    assert results["results"]["kvstore/lru"]["requests"] == 80 and results["results"]["kvstore/lru"]["wrong_blocks"] == 0
    bad = subprocess.run([sys.executable, "bench/trace_replay.py", "--generate", "agent", "--block-kb", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--block-kb" in bad.stderr
    bad = subprocess.run([sys.executable, "bench/trace_replay.py", "--generate", "agent", "--policies", "lfu"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--policies takes cost_aware, lru, s3fifo" in bad.stderr
