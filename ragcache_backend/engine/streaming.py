"""Draining a request's output queue into a stream of chunks (sync and async).

The engine's step loop puts text deltas (and finally a result or an exception) on a queue per
request; these helpers turn that queue into an iterator for the caller.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Iterator


def drain(out: queue.Queue) -> Iterator:
    """Yield stream chunks put on ``out`` by a worker thread until the one carrying ``result``;
    an exception put on the queue is raised in the consumer."""
    while True:
        item = out.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.result is not None:
            return


async def adrain(out: asyncio.Queue) -> AsyncIterator:
    """Async form of :func:`drain`."""
    while True:
        item = await out.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.result is not None:
            return
