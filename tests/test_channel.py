"""imp.actors.channel: the one-consumer FIFO under every actor's inbox and every request's stream."""

from __future__ import annotations

import asyncio

import pytest

from imp.actors.channel import Channel


def test_items_come_out_in_order_and_a_sleeping_reader_wakes():
    async def go():
        ch = Channel()
        ch.put_nowait(1)
        ch.put_nowait(2)
        assert (ch.qsize(), ch.peek(), await ch.get(), ch.get_nowait()) == (2, 1, 1, 2) and ch.empty()
        with pytest.raises(asyncio.QueueEmpty):
            ch.get_nowait()
        reader = asyncio.ensure_future(ch.get())
        await asyncio.sleep(0)
        assert not reader.done()
        ch.put_nowait(3)
        ch.put_nowait(4)
        assert await reader == 3 and await ch.get() == 4

    asyncio.run(go())


def test_a_cancelled_reader_loses_nothing_and_a_second_reader_is_refused():
    async def go():
        ch = Channel()
        first = asyncio.ensure_future(ch.get())
        await asyncio.sleep(0)
        second = asyncio.ensure_future(ch.get())
        await asyncio.sleep(0)
        assert isinstance(second.exception(), RuntimeError)  # one consumer at a time
        first.cancel()
        await asyncio.sleep(0)
        ch.put_nowait("x")  # put after the reader was cancelled: kept for the next get
        assert first.cancelled() and await asyncio.wait_for(ch.get(), 1) == "x"
        late = asyncio.ensure_future(ch.get())
        await asyncio.sleep(0)
        ch.put_nowait("y")  # the reader's future has its result, then the reader is cancelled before it runs:
        late.cancel()  # it never takes the item, which waits for the next get
        await asyncio.sleep(0)
        assert await asyncio.wait_for(ch.get(), 1) == "y"

    asyncio.run(go())
