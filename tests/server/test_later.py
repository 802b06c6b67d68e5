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
