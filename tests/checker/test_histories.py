"""The history checker's rules on hand-written histories: each rule flags the history that
breaks it, and passes the ones that look alike but are legal (a checker that cannot fail
proves nothing)."""

import json

from checker.histories import History, Life
from checker.values import decode, encode

NS, KEY = 1, 3


class Writer:
    """Records of one worker, as tests/checker/workers.py writes them."""

    def __init__(self, name: str = "w"):
        self.name, self.lines, self.seq = name, [], 0

    def call(self, op, t0, t1, out, keys=(KEY,), ns=NS, **extra):
        self.seq += 1
        self.lines.append(json.dumps({"e": "begin", "w": self.name, "i": self.seq, "op": op, "ns": ns,
                                      "keys": list(keys), "t": t0, **extra}))
        if t1 is not None:
            self.lines.append(json.dumps({"e": "end", "i": self.seq, "t": t1, "out": out,
                                          **({"dur": extra.pop("dur")} if "dur" in extra else {})}))

    def put(self, v, t0, t1, out="ok", **extra):
        self.call("put", t0, t1, out, v=v, **extra)

    def read(self, got, t0, t1, op="get_into"):
        self.call(op, t0, t1, [got])

    def delete(self, t0, t1, out="ok"):
        self.call("delete", t0, t1, out)


def judge(*writers, promise="none", lives=()) -> list:
    history = History(promise=promise, lives=list(lives))
    for w in writers:
        history.load(w.lines)
    return [a.rule for a in history.check()]


def test_a_read_of_a_version_put_before_it_passes():
    w = Writer()
    w.put(7, 1.0, 1.1)
    w.read(7, 1.2, 1.3)
    w.read(7, 1.05, 1.06)  # overlapping the put: it may have landed
    assert judge(w) == []


def test_bytes_of_another_key_or_namespace_or_torn_are_foreign():
    assert decode(NS, KEY, encode(NS, KEY, 5)) == 5
    other_ns, other_key = decode(NS, KEY, encode(NS + 1, KEY, 5)), decode(NS, KEY, encode(NS, KEY + 8, 5))
    torn = encode(NS, KEY, 5)
    torn[-8:] = encode(NS, KEY, 6)[-8:]
    for bad in (other_ns, other_key, decode(NS, KEY, torn)):
        assert bad.startswith("bad")
        w = Writer()
        w.put(5, 1.0, 1.1)
        w.read(bad, 1.2, 1.3)
        assert judge(w) == ["foreign"], bad


def test_a_version_never_put_or_put_only_after_the_read_is_a_phantom():
    w = Writer()
    w.read(9, 1.0, 1.1)
    w.put(9, 1.2, 1.3)
    assert judge(w) == ["phantom"]


def test_a_version_that_conflicted_or_existed_explains_no_read():
    w = Writer()
    w.put(4, 1.0, 1.1, out="conflict")
    w.put(5, 1.0, 1.1, out="existed")
    w.read(4, 1.2, 1.3)
    w.read(5, 1.2, 1.3)
    assert judge(w) == ["phantom", "phantom"]


def test_a_read_after_an_acknowledged_delete_is_a_resurrection():
    w = Writer()
    w.put(7, 1.0, 1.1)
    w.delete(1.2, 1.3)
    w.read(7, 1.4, 1.5)
    assert judge(w) == ["resurrected"]


def test_a_delete_overlapping_the_read_or_not_acknowledged_kills_nothing():
    w = Writer()
    w.put(7, 1.0, 1.1)
    w.delete(1.35, 1.6)  # overlaps the read
    w.delete(1.2, None)  # never ended (interrupted): may or may not have run
    w.read(7, 1.4, 1.5)
    assert judge(w) == []


def test_a_version_put_again_after_the_delete_is_alive_again():
    w = Writer()
    w.put(7, 1.0, 1.1)
    w.delete(1.2, 1.3)
    w.put(7, 1.4, 1.5)  # the same version again ("put_again")
    w.read(7, 1.6, 1.7)
    assert judge(w) == []


def test_a_put_of_unknown_outcome_is_never_dead():
    w = Writer()
    w.put(7, 1.0, None)  # cancelled, interrupted or killed: it may land any time
    w.delete(1.2, 1.3)
    w.read(7, 1.4, 1.5)
    assert judge(w) == []


def test_a_read_past_the_ttl_is_expired():
    w = Writer()
    w.put(7, 1.0, 1.1, ttl=0.3)
    w.read(7, 1.3, 1.31)  # within
    w.read(7, 1.5, 1.51)  # past 1.1 + 0.3 (+ the margin)
    assert judge(w) == ["expired"]


def test_a_miss_of_a_durable_put_breaks_only_the_promise_made():
    def history(dur):
        w = Writer()
        w.put(7, 1.0, 1.1, dur=dur)
        w.read("miss", 2.0, 2.1)
        return w
    assert judge(history("sync"), promise="none") == []
    assert judge(history("sync"), promise="write_through") == ["lost"]
    assert judge(history("memory"), promise="write_through") == []  # the put said it was not durable
    assert judge(history("memory"), promise="write_back") == ["lost"]
    # write_back keeps what memory held across a clean stop only.
    dirty = [Life(0.0, 1.5, clean=False), Life(1.6)]
    assert judge(history("memory"), promise="write_back", lives=dirty) == []
    clean = [Life(0.0, 1.5, clean=True), Life(1.6)]
    assert judge(history("memory"), promise="write_back", lives=clean) == ["lost"]


def test_a_deferred_put_promises_only_if_it_began_after_the_last_sigkill():
    # put(wait=False) is stored at the worker's next call and reported by a later flush: one
    # stored before a SIGKILL and reported after it was lost with that daemon, rightly.
    dirty = [Life(0.0, 1.5, clean=False), Life(1.6)]
    def history(t0):
        w = Writer()
        w.put(7, t0, 1.8, dur="memory", deferred=True)
        w.read("miss", 2.0, 2.1)
        return w
    assert judge(history(1.4), promise="write_back", lives=dirty) == []
    assert judge(history(1.7), promise="write_back", lives=dirty) == ["lost"]
    assert judge(history(1.4), promise="write_back", lives=[Life(0.0)]) == ["lost"]


def test_a_miss_after_a_delete_or_of_a_ttl_put_is_no_loss():
    w = Writer()
    w.put(7, 1.0, 1.1, dur="sync")
    w.delete(1.5, None)  # an interrupted delete may have run
    w.read("miss", 2.0, 2.1)
    w2 = Writer("v")
    w2.put(8, 1.0, 1.1, dur="sync", ttl=60.0, keys=(KEY + 1,))
    w2.call("get_into", 2.0, 2.1, ["miss"], keys=(KEY + 1,))
    assert judge(w, w2, promise="write_through") == []


def test_a_lookup_hit_needs_a_live_put():
    w = Writer()
    w.call("lookup", 0.5, 0.6, ["held"])
    w.put(7, 1.0, 1.1)
    w.call("lookup", 1.2, 1.3, ["held"])
    w.delete(1.4, 1.5)
    w.call("lookup", 1.6, 1.7, ["held"])
    assert judge(w) == ["resurrected", "resurrected"]


def test_a_group_read_mixing_two_group_puts_is_torn():
    w = Writer()
    w.call("put_group", 1.0, 1.1, "ok", keys=(30, 31), v=1)
    w.call("put_group", 1.2, 1.3, "ok", keys=(30, 31), v=2)
    w.call("get_group", 1.4, 1.5, [1, 1], keys=(30, 31))
    w.call("get_group", 1.4, 1.5, [1, 2], keys=(30, 31))
    assert judge(w) == ["torn group"]


def test_records_cut_by_a_sigkill_are_read_as_calls_that_never_ended():
    w = Writer()
    w.put(7, 1.0, 1.1)
    w.lines.append('{"e": "begin", "w": "w", "i": 99, "op": "delete", "ns": 1, "ke')  # cut mid-line
    w.read(7, 1.4, 1.5)
    history = History()
    history.load(w.lines)
    assert history.check() == [] and history.num_ops == 2
