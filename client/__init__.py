"""Thin in-process client for the kvstore daemon (sync and asyncio)."""

from client.results import LookupResult, PutResult
from client.lease import ReadLease
from client.aio import AsyncClient
from client.sync import Client
from kvstore.errors import DaemonUnavailable, LeaseEnded

__all__ = ["AsyncClient", "Client", "DaemonUnavailable", "LeaseEnded", "LookupResult", "PutResult", "ReadLease"]
