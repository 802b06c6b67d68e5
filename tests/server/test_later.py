"""server/later.py: the one way the daemon says "answer now, or after I/O"."""

import asyncio

from kvstore.server.later import is_ready, resolve, then


async def _answer(value):
    await asyncio.sleep(0)
    return value


def test_a_ready_answer_is_used_as_is_and_mapped_at_once():
    assert is_ready(3) and is_ready(None) and is_ready({"hit": False})
    assert then(3, lambda n: n + 1) == 4
    assert asyncio.run(resolve(3)) == 3


def test_an_answer_after_io_is_awaited_once_and_mapped_after():
    async def main():
        pending = _answer(3)
        assert not is_ready(pending)
        mapped = then(pending, lambda n: n + 1)
        assert not is_ready(mapped)
        assert await resolve(mapped) == 4
        task = asyncio.ensure_future(_answer(5))  # a task or future resolves the same way
        assert not is_ready(task) and await resolve(task) == 5
    asyncio.run(main())


def test_a_mapping_that_itself_answers_later_is_awaited_in_turn():
    """A reserve that had to demote first, then a commit that waits for its durable write:
    then() gives the commit's answer, never its awaitable as if it were the answer."""
    async def main():
        chained = then(_answer(3), lambda n: _answer(n * 10))
        assert not is_ready(chained)
        assert await resolve(chained) == 30
        now_then_later = then(3, lambda n: _answer(n + 2))  # ready first: fn's answer as it is
        assert not is_ready(now_then_later) and await resolve(now_then_later) == 5
    asyncio.run(main())
