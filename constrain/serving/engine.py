"""Continuous batching for servers: one thread owns a :class:`~constrain.decode.loop.DecodeLoop`; any thread
submits requests, which join the running batch between steps, and cancels them.

The engine knows nothing of HTTP: a request's ``on_event`` (set before submitting) sees its text as it
is produced, on the engine thread, and ``on_done`` gets the final result there too, so callers hand
both over to their own thread or event loop (``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from constrain.decode.loop import DecodeLoop
from constrain.decode.request import InFlight
from constrain.decode.speculative import Proposer
from constrain.models.cost import ForwardCost
from constrain.models.loading import ModelHandle
from constrain.results import GenerationResult

__all__ = ["Engine"]

Done = Callable[[InFlight, GenerationResult | BaseException], None]
"""Called once per request with the request and its result (or the exception that ended it)."""


class Engine:
    """Serve requests from many threads with one running batch.

    Parameters
    ----------
    handle : the model
    max_batch : int, default: 32
        Most requests in the batch at once; later ones wait, in order of arrival.
    jump_forward, speculative, forward_cost : as in :func:`constrain.generate`

    A failure of a step (which would be a bug, or the model running out of memory) ends every request
    in flight with that exception and the engine keeps serving new ones.
    """

    def __init__(
        self,
        handle: ModelHandle,
        *,
        max_batch: int = 32,
        jump_forward: bool = True,
        speculative: bool | Proposer = True,
        forward_cost: ForwardCost | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.handle = handle
        self.max_batch = max_batch
        self._new_loop = functools.partial(
            DecodeLoop, handle, jump_forward=jump_forward, speculative=speculative, forward_cost=forward_cost
        )
        self._inbox: queue.SimpleQueue[tuple[str, Any, Done | None]] = queue.SimpleQueue()
        self._waiting: list[tuple[InFlight, Done]] = []
        self._running: dict[int, tuple[InFlight, Done]] = {}
        self._closed = False
        self.steps = 0  # forward passes run, for tests and metrics
        self.peak_batch = 0  # most requests in the batch at once
        self._changed = threading.Condition()  # notified after every step: wait_idle
        self._thread = threading.Thread(target=self._serve, name="constrain-engine", daemon=True)
        self._thread.start()

    def submit(self, requests: Sequence[InFlight], on_done: Done) -> None:
        """Queue ``requests`` (built by ``constrain.generate.admit``, their ``on_event`` set if
        wanted); ``on_done(request, result)`` is called once per request, on the engine thread."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        for r in requests:
            self._inbox.put(("submit", r, on_done))

    def cancel(self, request: InFlight) -> None:
        """Stop ``request`` between steps (``finish_reason="cancelled"``) and free its batch row."""
        self._inbox.put(("cancel", request, None))

    def close(self, timeout: float | None = 10.0) -> None:
        """Finish the step in progress, cancel everything still queued or running, stop the thread."""
        self._closed = True
        self._inbox.put(("close", None, None))
        self._thread.join(timeout)

    @property
    def running(self) -> int:
        """Requests in the batch now (read-only, from any thread; changes between steps)."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Requests taken in but not yet in the batch (beyond ``max_batch``); the inbox not yet read is not counted."""
        return len(self._waiting)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no request is running or waiting (checked after every step), at most ``timeout``
        seconds: True once idle, False on timeout. Changes nothing."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._running and not self._waiting, timeout)

    def _serve(self) -> None:
        loop = self._new_loop()
        try:
            while True:
                if not self._take(loop, block=not loop.busy and not self._waiting):
                    for r, done in self._waiting + list(self._running.values()):
                        loop.cancel(r)
                        done(r, r.result())
                    return
                try:
                    loop.step()
                    self.steps += 1
                except Exception as err:  # a failed step: end what ran in it, keep serving
                    for r, done in self._running.values():
                        done(r, err)
                    self._running.clear()
                    loop.close()
                    loop = self._new_loop()
                for key, (r, done) in list(self._running.items()):
                    if r.finish_reason is not None:
                        del self._running[key]
                        done(r, r.result())
                with self._changed:
                    self._changed.notify_all()
        finally:  # also when a callback raised and ends this thread: the loop's mask thread goes with it
            loop.close()

    def _take(self, loop: DecodeLoop, *, block: bool) -> bool:
        """Move the inbox into the loop (submissions up to ``max_batch``, cancellations); False on close."""
        while True:
            try:
                kind, request, done = self._inbox.get(block=block)
            except queue.Empty:
                break
            block = False
            if kind == "close":
                return False
            if kind == "submit":
                assert done is not None
                self._waiting.append((request, done))
            elif id(request) in self._running:
                loop.cancel(request)  # leaves the batch at the next step, reported below
            else:
                for k, (r, waiting_done) in enumerate(self._waiting):
                    if r is request:
                        del self._waiting[k]
                        loop.cancel(r)
                        waiting_done(r, r.result())
                        break
        room = self.max_batch - len(self._running)
        joining, self._waiting = self._waiting[:room], self._waiting[room:]
        loop.add([r for r, _ in joining])
        self._running.update((id(r), (r, done)) for r, done in joining)
        self.peak_batch = max(self.peak_batch, len(self._running))
        return True
