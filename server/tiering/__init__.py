"""The chain of tiers on one node: the tier manager (ops of the local protocol), the host tier,
NVMe movement, GPU copies, and the null tiers that stand in for those switched off."""
