"""Workers (tiers/mooncake/workers.py): blocking calls off the event loop, and a cancelled
caller still waits for its call, which may be writing into the caller's memory."""

import asyncio
import threading

import pytest

from kvstore.tiers.mooncake.workers import Workers


def test_calls_run_off_the_loop_and_errors_come_back():
    async def main():
        workers = Workers(2, "test")
        loop_thread = threading.get_ident()
        assert await workers.run(threading.get_ident) != loop_thread
        with pytest.raises(ZeroDivisionError):
            await workers.run(lambda: 1 / 0)
        workers.close()
        with pytest.raises(RuntimeError):
            await workers.run(int)
    asyncio.run(main())


def test_cancelled_caller_waits_for_its_call_to_end():
    async def main():
        workers = Workers(1, "test")
        started, release, ended = threading.Event(), threading.Event(), threading.Event()

        def transfer():  # stands for a Mooncake call writing into an arena extent
            started.set()
            release.wait(10)
            ended.set()

        task = asyncio.ensure_future(workers.run(transfer))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done()  # still waiting: the memory is not given back under the call
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ended.is_set()
        workers.close()
    asyncio.run(main())
