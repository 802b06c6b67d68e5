"""The base of the local protocol's typed requests (kvstore/messages.py, kvstore/group_messages.py):
decoding a wire request's arguments field by field, encoding a message's, and the checks of
the `expect` / `expect_of` pair that batched ops share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from kvstore.errors import InvalidArgument
from kvstore.fields import NO_EXPECTATION


class Message:
    """Base of typed requests. Subclasses set `op` and `_codecs` (field -> codec)."""

    op: ClassVar[str]
    _codecs: ClassVar[dict[str, tuple[Callable, Callable]]]
    _defaults: ClassVar[dict[str, Any]] = {}

    @classmethod
    def from_args(cls, args: dict) -> Message:
        unknown = set(args) - set(cls._codecs)
        if unknown:
            raise InvalidArgument(f"{cls.op}: unknown field(s) {sorted(map(str, unknown))[:8]}")
        values = {}
        for name, (dec, _) in cls._codecs.items():
            if name in args:
                try:
                    values[name] = dec(args[name])
                except InvalidArgument as exc:
                    raise InvalidArgument(f"{cls.op}.{name}: {exc.message}") from None
            elif name in cls._defaults:
                values[name] = cls._defaults[name]
            else:
                raise InvalidArgument(f"{cls.op}: missing field {name!r}")
        return cls(**values)

    def to_args(self) -> dict:
        """The wire fields; one at its default is left out (the decoder fills it in), so a
        field added later does not break a reader that predates it unless it is used."""
        defaults, args = self._defaults, {}
        for name, (_, encode) in self._codecs.items():
            value = getattr(self, name)
            if name not in defaults or value != defaults[name]:
                args[name] = encode(value)
        return args


def check_expectations(op: str, expect, expect_of: bytes | None, n: int) -> None:
    """`expect_of` (one byte per id: an index into `expect`, or NO_EXPECTATION) fits `expect`."""
    if expect_of is None:
        return
    if expect is None or len(expect_of) != n:
        raise InvalidArgument(f"{op}.expect_of needs expect and one byte per id ({n} ids, {len(expect_of)} bytes)")
    if any(i >= len(expect) and i != NO_EXPECTATION for i in expect_of):
        raise InvalidArgument(f"{op}.expect_of: an index past expect's {len(expect)} descriptors")


def expectations(expect, expect_of: bytes | None, n: int) -> list | None:
    """Per id the descriptor it expects (or None); None when no id expects one."""
    if expect is None:
        return None
    if expect_of is None:
        return [expect[0]] * n
    return [None if i == NO_EXPECTATION else expect[i] for i in expect_of]
