"""The history checker against a real daemon (tests/checker/run.py): a bounded, seeded run of
each store configuration in the default suite, and a long soak under the `slow` marker.

    KVSTORE_CHECKER_SEED=N        the bounded runs' seed (default: fixed); the soak's first
    KVSTORE_CHECKER_SOAK_S=S      the soak's length (default 3600), in 10-minute runs
                                  rotating through the stores, each with a new seed

A failure prints the seed, the store and the anomalies; `python tests/checker/run.py --store
STORE --seed SEED --seconds S --keep DIR` runs it again and keeps the records.
"""

import os
import random
import tempfile
import time

import pytest

from checker.run import STORES, Plan, _crash_recorded, _worker_tracebacks, run

SEED = int(os.environ.get("KVSTORE_CHECKER_SEED", "20261206"))
BOUNDED_S = 25.0


def judged(plan: Plan, check: bool = True):
    kept = os.path.join(tempfile.gettempdir(), f"kvstore-checker-{plan.store}-{plan.seed}")
    outcome = run(plan, keep_if_anomalous=kept)
    print(outcome.summary(), flush=True)
    assert outcome.num_reads > 1000, f"too few reads judged to mean anything: {outcome.summary()}"
    if check:
        assert not outcome.anomalies, failure(outcome, kept)
    return outcome, kept


def failure(outcome, kept: str) -> str:
    plan = outcome.plan
    return (f"{outcome.summary()}\nthe run's records and the daemon's log: {kept}\nrun again: python "
            f"tests/checker/run.py --store {plan.store} --seed {plan.seed} --seconds {plan.seconds:g} --keep DIR\n"
            + "\n".join(map(str, outcome.anomalies[:40])))


def test_a_worker_that_crashed_is_an_anomaly(tmp_path):
    """A worker stopped by something that is no error of the store (a client's KeyError once)
    is a finding: its thread's exception, or a traceback its process printed. A warning is not."""
    (tmp_path / "p1.err").write_text("Traceback (most recent call last):\n  File ...\nKeyError: 'y'\n")
    (tmp_path / "p2.err").write_text("workers.py:9: RuntimeWarning: 1 deferred put(s) never stored\n")
    (tmp_path / "p3.err").write_text("")
    assert _worker_tracebacks(str(tmp_path)) == ["worker p1 crashed: Traceback (most recent call last): | "
                                                 "File ... | KeyError: 'y'"]
    crashes = []

    def worker():
        {}["y"]
    with pytest.raises(KeyError):
        _crash_recorded(crashes, "a3", worker)()
    assert len(crashes) == 1 and crashes[0].startswith("worker a3 crashed: KeyError('y') at ")
    assert crashes[0].endswith("(worker)")


@pytest.mark.parametrize("store", sorted(STORES))
def test_a_bounded_run_finds_no_anomaly(store):
    judged(Plan(store, SEED, BOUNDED_S))


@pytest.mark.slow
def test_the_soak_finds_no_anomaly():
    """Every run goes to its end (a failure is reported with the others, at the end)."""
    total_s = float(os.environ.get("KVSTORE_CHECKER_SOAK_S", "3600"))
    rng = random.Random(SEED)
    stores = sorted(STORES)
    deadline, done = time.monotonic() + total_s, []
    while time.monotonic() < deadline:
        store = stores[len(done) % len(stores)]
        seconds = min(600.0, max(30.0, deadline - time.monotonic()))
        done.append(judged(Plan(store, rng.randrange(1 << 31), seconds), check=False))
    print(f"soak: {len(done)} runs, {sum(o.num_ops for o, _ in done)} ops, "
          f"{sum(o.num_reads for o, _ in done)} reads judged, {sum(len(o.anomalies) for o, _ in done)} anomalies",
          flush=True)
    failed = [failure(o, kept) for o, kept in done if o.anomalies]
    assert not failed, "\n\n".join(failed)
