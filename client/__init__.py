"""Thin in-process client for the kvstore daemon (sync and asyncio)."""

from kvstore.client.results import LookupResult, PutResult
from kvstore.client.lease import ReadLease
from kvstore.client.aio import AsyncClient
from kvstore.client.sync import Client
from kvstore.errors import DaemonUnavailable, LeaseEnded

__all__ = ["AsyncClient", "Client", "DaemonUnavailable", "LeaseEnded", "LookupResult", "PutResult", "ReadLease"]
