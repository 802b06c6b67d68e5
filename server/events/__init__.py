"""The KV event stream for prefix-aware routers (`[events]`): vLLM's wire format.

`stream.py` batches what the tiers report on the event loop, `publisher.py` sends the
batches from its own thread over ZMQ and answers replays and snapshots, `holdings.py` keeps
what was published as held, `snapshot.py` lists it for a router, `wire.py` is the format.
"""

from kvstore.server.events.stream import EventStream, NoEvents
from kvstore.server.events.wire import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_PEER, MEDIUM_STORAGE, topic_of

__all__ = ["EventStream", "NoEvents", "MEDIUM_CPU", "MEDIUM_GPU", "MEDIUM_PEER", "MEDIUM_STORAGE", "topic_of"]
