"""Running one HTTP request's generations: a task per choice feeding one queue, so that a client
that leaves, or an error in one choice, cancels them all and each aborts in the scheduler."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from starlette.requests import Request

from radixserve.engine.messages import TextOut
from radixserve.engine.tokenizer_manager import GenerateInput, TokenizerManager
from radixserve.server.errors import ClientGone
from radixserve.server.metrics import RequestTrack
from radixserve.server.responses import Choice

T = TypeVar("T")
_END = object()


class Generation:
    """The engine requests behind one HTTP request, one per choice (prompts x n).

    Each runs in its own task rather than in the handler's: a task cancelled once runs the
    tokenizer manager's cleanup (the abort message) to completion, whereas the framework's
    cancel scope would cancel that cleanup's awaits too.
    """

    def __init__(
        self, tm: TokenizerManager, inputs: Sequence[GenerateInput], tracks: list[RequestTrack],
        live: set[Generation],
    ) -> None:  # fmt: skip
        self._live = live  # every open Generation of the server, this one until it is closed
        live.add(self)
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._open = len(inputs)
        self.choices = [Choice(i) for i in range(len(inputs))]
        self._tasks = [
            asyncio.create_task(self._pump(tm, i, inp, track))
            for i, (inp, track) in enumerate(zip(inputs, tracks, strict=True))
        ]

    async def _pump(
        self, tm: TokenizerManager, index: int, inp: GenerateInput, track: RequestTrack
    ) -> None:
        try:
            async for out in tm.generate(inp):
                track.on_output(out)
                self._queue.put_nowait((index, out))
        except asyncio.CancelledError:
            track.end("abort")
            raise
        except Exception as e:  # handed to the consumer, who turns it into a response
            track.end("error")
            self._queue.put_nowait((index, e))
            return
        self._queue.put_nowait((index, _END))

    async def outputs(self) -> AsyncIterator[tuple[Choice, TextOut]]:
        """Each delta as it arrives, already added to its choice; raises the first error."""
        while self._open:
            index, item = await self._queue.get()
            if item is _END:
                self._open -= 1
                continue
            if isinstance(item, Exception):
                raise item
            choice = self.choices[index]
            choice.add(item)
            yield choice, item

    async def collect(self) -> list[Choice]:
        async for _ in self.outputs():
            pass
        return self.choices

    def close(self) -> None:
        """Abort every choice still running (a no-op for those that finished)."""
        self._live.discard(self)
        for task in self._tasks:
            task.cancel()

    def fail(self, error: Exception) -> None:
        """Abort every choice; the consumer gets the outputs so far, then ``error`` is raised."""
        self.close()
        self._queue.put_nowait((0, error))


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first: then cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        raise ClientGone()
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    # The body is already read, so the server's receive() only returns on a disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
