"""Storage tiers. Each module is one tier; tiers never import each other.

`allocator`, `arena` and `leases` are the host tier's memory pieces: bookkeeping and mappings
that a tier uses, not tiers themselves, and they import nothing but `kvstore`.
"""
