"""The daemon's KV events scored by a real router's indexer: Dynamo's (dynamo_indexer.py).

Three daemons are three workers of one Dynamo indexer. Dynamo reads each with its own ZMQ
listener, through a relay (event_relay.py) that changes the four fields Dynamo 1.6 cannot
take as the daemon publishes them (integer block hashes, token ids, the parent block, no
`ownership`): everything else Dynamo reads is the daemon's, and the ranking is Dynamo's.
Worker 1 holds a prompt in its host tier (medium CPU), worker 2 on NVMe only (STORAGE),
worker 3 other prompts only. The last test shows why the relay is there.
"""

import pytest

from dynamo_indexer import NOTHING, DynamoIndexer, Held
from event_relay import Prompts, Relay
from kvs_events import EventSubscriber, endpoints, last_seq, wait_subscribed
from kvs_testing import payload, wait_until
from kvstore.identity import StateDescriptor

pytestmark = pytest.mark.engines

CHUNK_TOKENS = 16  # tokens per object, and Dynamo's block_size
# 1 MiB objects (raw bf16 elements), so a 4 MiB arena demotes a prompt to NVMe in a few puts.
DESC = StateDescriptor("default", "m", "r", layout="raw(bytes=524288)", chunk_tokens=CHUNK_TOKENS)
EVENTS = {"events": {"enabled": True}}
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
    """A daemon whose `default` namespace Dynamo reads as worker `worker_id`, through a relay."""

    def __init__(self, daemon, worker_id: int, prompts, dynamo):
        self.worker_id, self.prompts, self.dynamo = worker_id, prompts, dynamo
        self.client = daemon.client()
        self.subscriber = EventSubscriber(daemon, "default")
        self.relay = Relay(self.subscriber, prompts, f"ipc://{daemon.root}/dynamo-relay.pub")
        dynamo.register(worker_id, self.relay.endpoint)
        wait_subscribed(self.subscriber, lambda: self.put(prompts.new(1)))
        self.sync(joining=True)

    def put(self, prompt) -> None:
        for key in prompt.keys:
            self.client.put(key, payload(DESC.object_bytes, key.object_id))

    def sync(self, joining: bool = False) -> None:
        """Put a fence (a new prompt), relay every batch up to it, and wait until Dynamo holds
        the fence: Dynamo applies a worker's batches in order, so it applied all before it."""
        fence = self.prompts.new(1)
        self.put(fence)
        last = last_seq(self.client, "default")
        self.subscriber.receive_until(lambda s: s.received[-1][0] >= last, "the fence's batch")
        self.relay.forward()

        def fenced() -> bool:
            if joining:  # Dynamo's subscription takes effect a moment after it registers
                self.relay.resend_last()
            return self.dynamo.held(fence.tokens).get(self.worker_id, NOTHING).longest_matched == CHUNK_TOKENS
        wait_until(fenced, WAIT_S, f"Dynamo to apply worker {self.worker_id}'s batches")

    def push_to_nvme(self, prompt) -> None:
        """Put other prompts until every object of `prompt` left the host arena for NVMe."""
        for _ in range(MAX_FILLERS):
            if self.client.lookup(prompt.keys).tiers == ("nvme",) * len(prompt.keys):
                return
            self.put(self.prompts.new(1))
        raise AssertionError(f"{MAX_FILLERS} objects put did not demote the prompt to NVMe only")

    def close(self) -> None:
        self.client.close()
        self.relay.close()
        self.subscriber.close()


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


def refused_batches(dynamo, worker_id: int) -> int:
    """Live batches of `worker_id` that Dynamo's listener could not decode (its log says so)."""
    return sum(1 for r in dynamo.log_records()
               if r.get("message", "").startswith("Failed to decode KvEventBatch") and r.get("self.worker_id") == worker_id)


def test_dynamo_refuses_the_daemons_own_events_until_they_carry_what_it_needs(daemon_factory, dynamo, prompts):
    """Dynamo reading the daemon's endpoint itself indexes nothing: it cannot decode a batch
    whose block_hashes are 32-byte strings (it takes 64-bit integers). Past that, it would store
    no block without token ids and drop every event whose ownership is set (event_relay.py).
    When this test fails, the daemon's events carry what Dynamo needs: register the daemons
    themselves in the test above and drop the relay."""
    d = daemon_factory("32MiB", EVENTS)
    dynamo.register(1, endpoints(d)[0])
    prompt = prompts.new(4)
    with d.client() as c:
        def put(key):
            c.put(key, payload(DESC.object_bytes, key.object_id))

        def poked() -> bool:  # Dynamo's subscription takes effect a moment after it registers
            put(prompts.new(1).keys[0])
            return refused_batches(dynamo, 1) > 0
        wait_until(poked, WAIT_S, "Dynamo reading worker 1's batches")
        for key in prompt.keys:  # one batch each: Dynamo has read it once it refused it
            before = refused_batches(dynamo, 1)
            put(key)
            wait_until(lambda: refused_batches(dynamo, 1) > before, WAIT_S,
                       "Dynamo refusing the batch of a put: does the daemon publish integer block hashes now?")
    assert dynamo.held(prompt.tokens).get(1, NOTHING) == NOTHING
