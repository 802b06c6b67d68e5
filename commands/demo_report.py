"""What `kvstore demo` shows at the end: a table per turn, a JSON report, a PNG plot."""

from __future__ import annotations

import json
import os
import sys


class Progress:
    """A plain progress bar on stderr (carriage-return updates, no dependencies)."""

    WIDTH = 28

    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.done, self.stream = total, 0, stream

    def show(self, label: str) -> None:
        filled = self.WIDTH * self.done // max(1, self.total)
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {label[:40]:<40}")
        self.stream.flush()

    def advance(self, label: str) -> None:
        self.done += 1
        self.show(label)

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def print_table(rows: list[dict], out=sys.stdout, groups: bool = False) -> None:
    """One line per turn; `groups`: also the store groups each turn saved and read (hybrid rows)."""
    header = (f"{'turn':<20} {'prompt':>6} {'hit host':>8} {'hit nvme':>8} "
              + (f"{'groups saved':>12} {'read':>4} " if groups else "")
              + f"{'TTFT store':>11} {'TTFT recompute':>14} {'speedup':>7}  identical")
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in rows:
        hits = r["hit_tokens"]
        speedup = r["ttft_recompute_ms"] / r["ttft_store_ms"] if r["ttft_store_ms"] else 0.0
        print(f"{r['turn']:<20} {r['prompt_tokens']:>6} {hits.get('host', 0):>8} {hits.get('nvme', 0):>8} "
              + (f"{r['groups_saved']:>12} {r['groups_read']:>4} " if groups else "")
              + f"{r['ttft_store_ms']:>8.0f} ms {r['ttft_recompute_ms']:>11.0f} ms {speedup:>6.1f}x  "
              f"{'yes' if r['identical'] else 'NO'}", file=out)


def summary(rows: list[dict]) -> dict:
    hits: dict[str, int] = {}
    for r in rows:
        for tier, n in r["hit_tokens"].items():
            hits[tier] = hits.get(tier, 0) + n
    return {
        "turns": len(rows),
        "identical_turns": sum(r["identical"] for r in rows),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "hit_tokens": hits,
        "ttft_store_s": round(sum(r["ttft_store_ms"] for r in rows) / 1e3, 3),
        "ttft_recompute_s": round(sum(r["ttft_recompute_ms"] for r in rows) / 1e3, 3),
    }


def hybrid_summary(hybrid: dict) -> dict:
    """summary() of the hybrid turns, with the store groups saved and the turns that hit one."""
    rows = hybrid["turns"]
    return {**summary(rows), "hit_tokens": sum(sum(r["hit_tokens"].values()) for r in rows),
            "groups_saved": hybrid["groups_saved"], "group_hits": sum(r["groups_read"] for r in rows)}


def write_json(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def plot(rows: list[dict], path: str, title: str) -> str | None:
    """Bars of TTFT per turn, with and without the store; None (and a reason) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot"
    labels = [r["turn"] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(rows)), 4.2))
    ax.bar([i - 0.2 for i in x], [r["ttft_recompute_ms"] for r in rows], 0.4, label="recompute", color="#b0b0b0")
    ax.bar([i + 0.2 for i in x], [r["ttft_store_ms"] for r in rows], 0.4, label="with kvstore", color="#2b7bba")
    for i, r in enumerate(rows):
        hit = sum(r["hit_tokens"].values())
        ax.annotate(f"{hit}/{r['prompt_tokens']}", (i + 0.2, r["ttft_store_ms"]), ha="center",
                    va="bottom", fontsize=7)
    ax.set_xticks(list(x), labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
