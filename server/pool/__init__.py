"""A shared pool as the remote tier (`[remote] backend = "mooncake"`): server/pool/link.py."""
