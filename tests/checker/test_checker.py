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
import time

import pytest

from checker.run import STORES, Plan, run

SEED = int(os.environ.get("KVSTORE_CHECKER_SEED", "20261206"))
BOUNDED_S = 25.0


def judged(plan: Plan):
    outcome = run(plan)
    print(outcome.summary(), flush=True)
    assert outcome.num_reads > 1000, f"too few reads judged to mean anything: {outcome.summary()}"
    assert not outcome.anomalies, (
        f"{outcome.summary()}\nrun again: python tests/checker/run.py --store {plan.store} --seed {plan.seed} "
        f"--seconds {plan.seconds:g} --keep DIR\n" + "\n".join(map(str, outcome.anomalies[:40])))
    return outcome


@pytest.mark.parametrize("store", sorted(STORES))
def test_a_bounded_run_finds_no_anomaly(store):
    judged(Plan(store, SEED, BOUNDED_S))


@pytest.mark.slow
def test_the_soak_finds_no_anomaly():
    total_s = float(os.environ.get("KVSTORE_CHECKER_SOAK_S", "3600"))
    rng = random.Random(SEED)
    stores = sorted(STORES)
    deadline, done = time.monotonic() + total_s, []
    while time.monotonic() < deadline:
        store = stores[len(done) % len(stores)]
        seconds = min(600.0, max(30.0, deadline - time.monotonic()))
        done.append(judged(Plan(store, rng.randrange(1 << 31), seconds)))
    print(f"soak: {len(done)} runs, {sum(o.num_ops for o in done)} ops, "
          f"{sum(o.num_reads for o in done)} reads judged, 0 anomalies")
