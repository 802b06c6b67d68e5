"""Storage tiers. Each module or package is one tier; tiers never import each other.

`allocator`, `arena` and `leases` are the host tier's memory pieces: bookkeeping and mappings
that a tier uses, not tiers themselves, and they import nothing but `kvstore`. `nvme/` and
`remote/` are tiers large enough to be packages; their `__init__` names what others import.
"""
