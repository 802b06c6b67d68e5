"""The daemon's KV events scored by a real router's indexer: Dynamo's (dynamo_indexer.py).

Three daemons are three workers of one Dynamo indexer, which reads each daemon's PUB endpoint
with its own ZMQ listener: nothing of ours between them. The objects are put with routes
(prompts.py: their tokens and parent, as an engine adapter hands them in). Worker 1 holds a
prompt in its host tier (medium CPU), worker 2 on NVMe only (STORAGE), worker 3 other
prompts only; the ranking is Dynamo's.
"""

import signal

import pytest

from dynamo_indexer import NOTHING, DynamoIndexer, Held
from kvs_events import endpoints
from kvs_testing import payload, wait_until
from kvstore.hints import Hints
from kvstore.identity import StateDescriptor
from prompts import Prompts

pytestmark = pytest.mark.engines

CHUNK_TOKENS = 16  # tokens per object, and Dynamo's block_size
# 1 MiB objects (raw bf16 elements), so a 4 MiB arena demotes a prompt to NVMe in a few puts.
DESC = StateDescriptor("default", "m", "r", layout="raw(bytes=524288)", chunk_tokens=CHUNK_TOKENS)
EVENTS = {"events": {"enabled": True}}  # the defaults: what Dynamo reads as they are
NVME = {**EVENTS, "nvme": {"enabled": True, "capacity_bytes": "64MiB", "file_bytes": "16MiB", "admit_min_hits": 0}}
WAIT_S = 20.0  # a liveness bound on Dynamo applying a batch (milliseconds on an idle machine)
MAX_FILLERS = 32  # objects put to push a prompt out of a 4 MiB arena (each 1 MiB)


@pytest.fixture
def dynamo(tmp_path):
    indexer = DynamoIndexer(CHUNK_TOKENS, str(tmp_path / "dynamo-indexer.log"))
    yield indexer
    indexer.close()


@pytest.fixture
def prompts():
    return Prompts(DESC)


class Node:
    """A daemon whose `default` namespace Dynamo reads as worker `worker_id`."""

    def __init__(self, daemon, worker_id: int, prompts, dynamo, replay: bool = False):
        """replay: register the replay endpoint too (Dynamo then asks it for what it missed)."""
        self.daemon, self.worker_id, self.prompts, self.dynamo = daemon, worker_id, prompts, dynamo
        self.client = daemon.client()
        dynamo.register(worker_id, *(endpoints(daemon) if replay else endpoints(daemon)[:1]))
        self.sync()

    def put(self, prompt, routes: bool = True) -> None:
        for key, route in zip(prompt.keys, prompt.routes):
            self.client.put(key, payload(DESC.object_bytes, key.object_id), hints=Hints(route=route if routes else None))

    def sync(self) -> None:
        """Put fences (new prompts) until Dynamo holds one: it applies a worker's batches in
        order, so then it applied everything put before. (Just registered, Dynamo subscribes a
        moment later and misses what came before: the next fence then tells.)"""
        fences = []

        def fenced() -> bool:
            if any(self.dynamo.held(f.tokens).get(self.worker_id, NOTHING).longest_matched for f in fences):
                return True
            fences.append(self.prompts.new(1))
            self.put(fences[-1])
            return False
        wait_until(fenced, WAIT_S, f"Dynamo to apply worker {self.worker_id}'s batches")

    def push_to_nvme(self, prompt) -> None:
        """Put other prompts until every object of `prompt` left the host arena for NVMe."""
        for _ in range(MAX_FILLERS):
            if self.client.lookup(prompt.keys).tiers == ("nvme",) * len(prompt.keys):
                return
            self.put(self.prompts.new(1))
        raise AssertionError(f"{MAX_FILLERS} objects put did not demote the prompt to NVMe only")

    def restart(self, sig, arena_bytes: str) -> None:
        """Stop the daemon with `sig` and start it again on its data directory."""
        self.client.close()
        assert self.daemon.stop(sig) is not None
        self.daemon.start(arena_bytes)
        self.client = self.daemon.client()

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def nodes(daemon_factory, dynamo, prompts):
    made = []

    def make(arena_bytes: str, config: dict) -> Node:
        made.append(Node(daemon_factory(arena_bytes, config), len(made) + 1, prompts, dynamo))
        return made[-1]

    yield make
    for node in made:
        node.close()


def test_dynamo_ranks_a_prefix_in_host_or_nvme_above_a_worker_without_it(nodes, dynamo, prompts):
    host, nvme, other = nodes("32MiB", EVENTS), nodes("4MiB", NVME), nodes("32MiB", EVENTS)
    prompt = prompts.new(4)
    host.put(prompt)
    nvme.put(prompt)
    nvme.push_to_nvme(prompt)
    other.put(prompts.new(4))
    for node in (host, nvme, other):
        node.sync()
    n = len(prompt.tokens)
    held = dynamo.held(prompt.tokens)
    assert held.get(host.worker_id) == Held(longest_matched=n, gpu=0, cpu=n, disk=n)
    assert held.get(nvme.worker_id) == Held(longest_matched=n, gpu=0, cpu=0, disk=n)
    assert held.get(other.worker_id, NOTHING) == NOTHING
    ranked = sorted(held, key=lambda worker: held[worker].longest_matched, reverse=True)
    assert set(ranked[:2]) == {host.worker_id, nvme.worker_id}

    # A delete is a BlockRemoved in the object's medium: Dynamo then matches up to the block before it.
    assert host.client.delete([prompt.keys[3]]) == 1
    assert nvme.client.delete([prompt.keys[1]]) == 1
    host.sync(), nvme.sync()
    held = dynamo.held(prompt.tokens)
    assert held.get(host.worker_id) == Held(longest_matched=3 * CHUNK_TOKENS, gpu=0, cpu=3 * CHUNK_TOKENS,
                                            disk=3 * CHUNK_TOKENS)
    assert held.get(nvme.worker_id) == Held(longest_matched=CHUNK_TOKENS, gpu=0, cpu=0, disk=CHUNK_TOKENS)


def test_dynamo_indexes_what_was_put_with_a_route_and_nothing_without(nodes, dynamo, prompts):
    """Without a route the daemon knows no tokens, and Dynamo matches prompts by hashing them:
    such objects are in the stream (named by their ids) but no prompt can match them."""
    node = nodes("32MiB", EVENTS)
    bare, routed = prompts.new(2), prompts.new(2)
    node.put(bare, routes=False)
    node.put(routed)
    node.sync()
    assert dynamo.held(bare.tokens).get(node.worker_id, NOTHING) == NOTHING
    n = len(routed.tokens)
    assert dynamo.held(routed.tokens).get(node.worker_id) == Held(longest_matched=n, gpu=0, cpu=n, disk=n)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_dynamo_drops_a_restarted_daemons_old_blocks_and_indexes_its_new_ones(daemon_factory, dynamo, prompts, sig):
    """Dynamo stays subscribed while the daemon restarts (issue 41, item 9): the new daemon's
    numbers skip past the old one's, Dynamo replays (vLLM's request) from its last number and
    gets the new daemon's first batch, AllBlocksCleared, then the new puts."""
    node = Node(daemon_factory("32MiB", EVENTS), 1, prompts, dynamo, replay=True)
    try:
        old = prompts.new(4)
        node.put(old)
        node.sync()
        n = len(old.tokens)
        assert dynamo.held(old.tokens).get(node.worker_id) == Held(longest_matched=n, gpu=0, cpu=n, disk=n)
        node.restart(sig, "32MiB")
        new = prompts.new(4)
        node.put(new)
        node.sync()
        assert dynamo.held(new.tokens).get(node.worker_id) == Held(longest_matched=n, gpu=0, cpu=n, disk=n)
        assert dynamo.held(old.tokens).get(node.worker_id, NOTHING) == NOTHING
    finally:
        node.close()
