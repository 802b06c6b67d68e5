"""Thin in-process client for the kvstore daemon (sync and asyncio)."""

from client.core import LookupResult, PutResult, ReadLease
from client.sync import Client
from kvstore.errors import DaemonUnavailable

__all__ = ["Client", "DaemonUnavailable", "LookupResult", "PutResult", "ReadLease"]
