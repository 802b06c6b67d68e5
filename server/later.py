"""Answer now, or after I/O: the one way the daemon says which.

A tier-manager call that may need NVMe or peer I/O (a reserve that must demote first, a
get that must promote or fetch, a lookup that asks peers, a delete of NVMe copies)
returns `MaybeAwaitable[T]`: the reply itself when it is ready, or an awaitable of it.
Callers never inspect it themselves:

    reply = await resolve(manager.get(...))          # a coroutine: wait if needed
    counted = then(manager.delete(...), DeleteReply)  # map over either form
    if is_ready(result): answer now, else run it as a task   # the local service's fast path

This module is the only place that tells the two forms apart.
"""

from __future__ import annotations

import inspect
from typing import Awaitable, Callable, TypeVar, Union

T = TypeVar("T")
U = TypeVar("U")

MaybeAwaitable = Union[T, Awaitable[T]]


def is_ready(value: MaybeAwaitable[T]) -> bool:
    """True when `value` is the answer itself; False when it is still to be awaited."""
    return not inspect.isawaitable(value)


async def resolve(value: MaybeAwaitable[T]) -> T:
    """The answer: `value` itself, or what awaiting it gives."""
    return value if is_ready(value) else await value


def then(value: MaybeAwaitable[T], fn: Callable[[T], MaybeAwaitable[U]]) -> MaybeAwaitable[U]:
    """fn(answer), now if `value` is ready, else as an awaitable of it. fn may itself
    answer later (a commit after a reserve): its awaitable is awaited in turn."""
    if is_ready(value):
        return fn(value)

    async def later() -> U:
        return await resolve(fn(await value))
    return later()


def each(items, run: Callable, done: Callable) -> MaybeAwaitable[None]:
    """run(item) for every item, in order, then done(item, answer, None), or done(item,
    None, exc) when run raised; a run that must wait for I/O is awaited before the next
    starts. None when no run had to wait (the fast path), else an awaitable of None.

        for item in items:
            try: done(item, await resolve(run(item)), None)
            except Exception as exc: done(item, None, exc)
    """
    items = iter(items)
    waiting = _run_until_wait(items, run, done)
    return None if waiting is None else _each_later(waiting, items, run, done)


def _run_until_wait(items, run: Callable, done: Callable):
    """Run items until one must wait: (that item, its awaitable), or None when all answered."""
    for item in items:
        try:
            answer = run(item)
        except Exception as exc:
            done(item, None, exc)
            continue
        if not is_ready(answer):
            return item, answer
        done(item, answer, None)
    return None


async def _each_later(waiting, items, run: Callable, done: Callable) -> None:
    while waiting is not None:
        item, pending = waiting
        try:
            done(item, await pending, None)
        except Exception as exc:
            done(item, None, exc)
        waiting = _run_until_wait(items, run, done)
