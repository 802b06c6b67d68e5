"""FailSoftLink against a real daemon: a refusal is a miss that leaves the link up, a failure
is a miss that takes it down for retry_after_s, and each is counted once."""

import signal

from kvstore.client.fail_soft import FailSoftLink
from kvstore.errors import InvalidArgument


def refuse(client):
    raise InvalidArgument("a buffer of the wrong size")


def test_a_refusal_leaves_the_link_up_and_a_failure_takes_it_down(daemon):
    link = FailSoftLink(daemon.socket, "default", timeout_s=2.0, retry_after_s=60.0)
    assert link.call(lambda client: client.stats()["leases"], -1) == 0
    assert link.call(refuse, "miss") == "miss"
    assert (link.num_refused, link.num_failures, link.num_errors, link.down) == (1, 0, 0, False)
    assert link.call(lambda client: client.stats()["leases"], -1) == 0  # the same connection
    daemon.stop(signal.SIGKILL)
    assert link.call(lambda client: client.stats(), "miss") == "miss"  # one fresh try, then down
    assert link.down and link.num_errors == 1 and link.last_error
    assert link.call(lambda client: client.stats()) is None  # skipped: no connect attempt
    assert (link.num_failures, link.num_errors, link.num_refused) == (2, 1, 1)
    assert link.stats() == {"num_failures": 2, "num_refused": 1, "last_error": link.last_error}
    link.close()
