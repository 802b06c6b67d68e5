"""Namespace access for local clients: the `[auth]` table of the daemon's config.

Pure validation, like the rest of kvstore/config.py (which composes AuthConfig into
ServerConfig); the daemon applies it in `Daemon.authorize`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument
from kvstore.identity import check_name

# Shorter tokens are guessable; 16 characters of a random token are 80+ bits.
MIN_TOKEN_CHARS = 16
AUTH_UNLISTED = ("allow", "deny")
_AUTH_RULE_KEYS = ("token", "uids")


@dataclass(frozen=True, slots=True)
class NamespaceAuth:
    """Who may open one namespace: the holder of `token` ("" = no token asked) and/or a
    peer whose uid is in `uids` (() = any uid). Both must hold when both are set."""

    token: str = field(default="", repr=False)  # never in logs
    uids: tuple = ()


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """Namespace access for local clients, on top of the socket's file mode.

        [auth]
        unlisted = "allow"            # namespaces not listed below: "allow" or "deny"
        [auth.namespaces.tenant-a]
        token = "at least 16 random characters"
        uids = [1000]                 # optional: SO_PEERCRED uid of the client

    A config file holding tokens should be mode 0600.
    """

    unlisted: str = "allow"
    namespaces: dict = field(default_factory=dict)  # name -> NamespaceAuth

    def __post_init__(self) -> None:
        if self.unlisted not in AUTH_UNLISTED:
            raise InvalidArgument(f"auth.unlisted must be one of {AUTH_UNLISTED}, got {self.unlisted!r}")
        if not isinstance(self.namespaces, dict):
            raise InvalidArgument("auth.namespaces must be a table of [auth.namespaces.<name>] tables")
        rules = {}
        for name, rule in self.namespaces.items():
            check_name("auth.namespaces: a namespace", name)  # before it is shown raw in a key below
            where = f"auth.namespaces.{name}"
            rules[name] = rule if isinstance(rule, NamespaceAuth) else _namespace_rule(where, rule)
        object.__setattr__(self, "namespaces", rules)

    @property
    def enabled(self) -> bool:
        """Do tenants need telling apart (some namespace is guarded, or unlisted ones denied)?"""
        return bool(self.namespaces) or self.unlisted == "deny"


def _namespace_rule(where: str, rule) -> NamespaceAuth:
    if not isinstance(rule, dict):
        raise InvalidArgument(f"{where} must be a table with token and/or uids")
    unknown = set(rule) - set(_AUTH_RULE_KEYS)
    if unknown:
        raise InvalidArgument(f"unknown config key(s) {sorted(f'{where}.{k}' for k in unknown)}; known: {list(_AUTH_RULE_KEYS)}")
    token, uids = rule.get("token", ""), rule.get("uids", [])
    if not isinstance(token, str) or (token and len(token) < MIN_TOKEN_CHARS):
        raise InvalidArgument(f"{where}.token must be a string of at least {MIN_TOKEN_CHARS} characters")
    if not isinstance(uids, (list, tuple)) or not all(
            isinstance(u, int) and not isinstance(u, bool) and 0 <= u < 2**32 for u in uids):
        raise InvalidArgument(f"{where}.uids must be a list of user ids (integers >= 0)")
    if not token and not uids:
        raise InvalidArgument(f"{where} needs a token or uids; to admit everyone leave it out (auth.unlisted)")
    return NamespaceAuth(token, tuple(uids))
