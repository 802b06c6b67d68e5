"""This daemon's part of a cluster: serving peers, fetching misses from homes, replicating to
homes, re-homing on membership changes, and membership itself (static or etcd)."""
