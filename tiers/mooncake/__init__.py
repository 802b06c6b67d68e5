"""The Mooncake Store client tier: this daemon's client of a shared Mooncake pool.

    pool.py     MooncakePool: the client (set up and probed in the background), batched calls
                on worker threads, memory registration, the pool's health and counters
    scratch.py  HeaderSlots: registered memory for the pool headers of a batch
    workers.py  Workers: daemon threads for the blocking Mooncake calls

The layout of a pool value (header, key naming) is kvstore/pool_header.py; the daemon's use
of the pool (what goes there and when, verification) is server/pool/link.py. The
`mooncake.store` bindings are imported only when a client is set up (extra `mooncake`).
"""

from kvstore.tiers.mooncake.pool import MooncakePool, PoolCounters

__all__ = ["MooncakePool", "PoolCounters"]
