import pytest

from kvstore.errors import InvalidArgument
from kvstore.policy.admission import FrequencyAdmission


def test_unseen_keys_are_rejected_and_read_keys_admitted():
    f = FrequencyAdmission(width=1024, min_hits=2)
    f.record("hot")
    assert not f.admit("hot") and not f.admit("cold")
    f.record("hot")
    assert f.admit("hot") and f.num_admitted == 1 and f.num_rejected == 2


def test_zero_min_hits_admits_everything():
    assert FrequencyAdmission(width=64, min_hits=0).admit("anything")


def test_estimates_never_undercount_and_saturate():
    f = FrequencyAdmission(width=64, sample_size=10**9)
    for i in range(200):
        for _ in range(i % 5):
            f.record(i)
    assert all(f.estimate(i) >= i % 5 for i in range(200))
    for _ in range(100):
        f.record("x")
    assert f.estimate("x") == 15


def test_aging_halves_old_counts():
    f = FrequencyAdmission(width=64, sample_size=20)
    for _ in range(8):
        f.record("old")
    assert f.estimate("old") >= 8
    for i in range(12):
        f.record(("new", i))
    assert f.estimate("old") <= 4 + 1  # halved once (collisions may add a little)


@pytest.mark.parametrize("width", [0, 100, 8])
def test_bad_width(width):
    with pytest.raises(InvalidArgument):
        FrequencyAdmission(width=width)
