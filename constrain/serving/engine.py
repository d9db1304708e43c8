"""Continuous batching for servers: one thread owns a :class:`~constrain.decode.loop.DecodeLoop`; any thread
submits requests, which join the running batch between steps, and cancels them.

The engine knows nothing of HTTP: a request's ``on_event`` (set before submitting) sees its text as it
is produced, on the engine thread, and ``on_done`` gets the final result there too, so callers hand
both over to their own thread or event loop (``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import inspect
import logging
import queue
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

from constrain.decode.loop import DecodeLoop
from constrain.decode.request import InFlight
from constrain.decode.speculative import Proposer
from constrain.models.cost import ForwardCost
from constrain.models.loading import ModelHandle
from constrain.results import GenerationResult

__all__ = ["TRIM_EVERY", "Engine", "heap_trimmer", "release_frames"]

log = logging.getLogger("constrain.serving.engine")

TRIM_EVERY = 16
"""The engine hands the heap's free memory back to the system (:func:`heap_trimmer`) after every this many
finished requests, and whenever it goes idle after finishing one."""


def heap_trimmer() -> Callable[[], None] | None:
    """glibc's ``malloc_trim(0)``, which returns the heap's free pages to the system; None without glibc.

    Why: a server's threads free tensors of every size (prompts' KV, logits, prefills) in glibc's
    per-thread arenas, which keep the pages. With SmolLM2 serving 100 requests of ~230-token prompts,
    8 at a time, resident memory stood at 3,599 MiB, and one ``malloc_trim(0)`` brought it to 2,043
    MiB (AMD EPYC, 2 cores); untrimmed, it grew by about 300 MiB every 100 requests after that.
    ctypes releases the GIL for the call.
    """
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return None
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int

    def run() -> None:
        trim(0)

    return run


def release_frames(err: BaseException) -> None:
    """Drop the local variables of the frames ``err``'s traceback went through that have returned (those
    still running are left alone); the traceback itself, its lines and logging of it, are kept.

    Also the callers of those frames that have returned (``f_back``: a frame keeps its caller's), and the
    frames of the exceptions it was raised in handling of (``__context__``, ``__cause__``). Frames of
    generators and coroutines are left alone (clearing a suspended one would close it).

    Why: an exception kept beyond its handling (a request's :attr:`~constrain.decode.request.InFlight.fault`)
    keeps every frame it passed through, and their locals: a decode step's logits and masks, tens of
    MiB each, and the failed request, whose ``fault`` is that exception again. That cycle waits for a
    full collection of the garbage collector, which a process holding a million objects runs seldom:
    in the chaos drill (8% of its requests end by an injected fault), 27 to 91 MiB of tensors were
    garbage waiting in such cycles after every hundred requests (``gc.DEBUG_SAVEALL``), and resident
    memory went up and down with them; none once released.
    """
    seen, chain = set(), [err]
    while chain:
        found = chain.pop()
        if id(found) in seen:
            continue
        seen.add(id(found))
        chain += [e for e in (found.__cause__, found.__context__) if e is not None]
        tb = found.__traceback__
        while tb is not None:
            frame: types.FrameType | None = tb.tb_frame
            while frame is not None:  # and its callers that have returned, up to a running one
                if frame.f_code.co_flags & _SUSPENDABLE:
                    break  # (clearing a suspended generator's or coroutine's frame would close it)
                try:
                    frame.clear()
                except RuntimeError:  # running
                    break
                frame = frame.f_back
            tb = tb.tb_next


_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


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
    prefix_cache_bytes : int or None, default: None (sized to the machine, at most 512 MiB)
        The bound on the prompts' KV kept for reuse (:class:`~constrain.decode.kv.PrefixCache`), in bytes.

    Notes
    -----
    One request never breaks another: a fault in one request's row (masking, sampling, advancing,
    detokenizing, its ``on_event``) ends that request alone, whose ``on_done`` gets the exception
    (:attr:`InFlight.fault <constrain.decode.request.InFlight.fault>`); its neighbours go on (see
    :class:`~constrain.decode.loop.DecodeLoop`). A failure no row is to blame for (the forward pass: out
    of memory) ends every request in flight with that exception, and the engine serves new ones on a
    fresh loop. Nothing a request or a callback raises ends the engine's thread: a raising ``on_done``
    is logged (``failures`` counts every request ended by a fault, ``callback_errors`` the callbacks).

    Memory: every :data:`TRIM_EVERY` finished requests, and when it goes idle, the engine hands the
    heap's free pages back to the system (:func:`heap_trimmer`, with glibc), so that a long-running
    server's resident memory follows what it holds; its caches are bounded (``constrain.cache_stats()``).
    The exception that ended a request is delivered with its frames' locals released (:func:`release_frames`).
    """

    def __init__(
        self,
        handle: ModelHandle,
        *,
        max_batch: int = 32,
        jump_forward: bool = True,
        speculative: bool | Proposer = True,
        forward_cost: ForwardCost | None = None,
        prefix_cache_bytes: int | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.handle = handle
        self.max_batch = max_batch
        self._new_loop = functools.partial(
            DecodeLoop,
            handle,
            jump_forward=jump_forward,
            speculative=speculative,
            forward_cost=forward_cost,
            prefix_cache_bytes=prefix_cache_bytes,
        )
        self._inbox: queue.SimpleQueue[tuple[str, Any, Done | None]] = queue.SimpleQueue()
        self._waiting: list[tuple[InFlight, Done]] = []
        self._running: dict[int, tuple[InFlight, Done]] = {}
        self._closed = False
        self.steps = 0  # forward passes run, for tests and metrics
        self.peak_batch = 0  # most requests in the batch at once
        self.failures = 0  # requests ended by a fault (theirs, or a step's)
        self.callback_errors = 0  # on_done calls that raised (logged)
        self.finished = 0  # requests delivered
        self.trim_seconds = 0.0  # spent handing free heap memory back (heap_trimmer), on the engine thread
        self._trim = heap_trimmer()
        self._trimmed_at = 0  # self.finished at the last trim
        self._changed = threading.Condition()  # notified after every step: wait_idle
        self._thread = threading.Thread(target=self._serve, name="constrain-engine", daemon=True)
        self._thread.start()

    def submit(self, requests: Sequence[InFlight], on_done: Done) -> None:
        """Queue ``requests`` (built by ``constrain.generation.admit``, their ``on_event`` set if
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
                try:
                    if not self._take(loop, block=not loop.busy and not self._waiting):
                        for r, done in self._waiting + list(self._running.values()):
                            loop.cancel(r)
                            self._deliver(r, done)
                        return
                    loop.step()
                    self.steps += 1
                except Exception as err:  # no row is to blame: end what ran in the step, keep serving
                    log.exception("a decode step failed: its %d requests end with the error", len(self._running))
                    for r, done in self._running.values():
                        r.fail(err, "stepping")
                        self._deliver(r, done)
                    self._running.clear()
                    loop.close()
                    loop = self._new_loop()
                for key, (r, done) in list(self._running.items()):
                    if r.finish_reason is not None:
                        del self._running[key]
                        self._deliver(r, done)
                if not self._running and not self._waiting and self._trimmed_at < self.finished:
                    self._trim_heap()  # idle: what the finished requests freed goes back
                with self._changed:
                    self._changed.notify_all()
        finally:  # the loop's mask thread goes with this one
            loop.close()

    def _trim_heap(self) -> None:
        """Hand the heap's free pages back to the system (:func:`heap_trimmer`; timed in ``trim_seconds``)."""
        if self._trim is not None:
            start = time.perf_counter()
            self._trim()
            self.trim_seconds += time.perf_counter() - start
        self._trimmed_at = self.finished

    def _deliver(self, r: InFlight, done: Done) -> None:
        """``done(r, outcome)``: ``r``'s fault if one ended it (or its result could not be made), else its
        result; what ``done`` raises is logged, never raised."""
        self.finished += 1
        if self.finished % TRIM_EVERY == 0:
            self._trim_heap()
        outcome: GenerationResult | BaseException
        if r.fault is not None:
            self.failures += 1
            outcome = r.fault
        else:
            try:
                outcome = r.result()
            except Exception as err:
                log.exception("request %s: its result could not be made", r.request_id or hex(id(r)))
                self.failures += 1
                outcome = err
        if isinstance(outcome, BaseException):
            release_frames(outcome)
        try:
            done(r, outcome)
        except Exception:
            self.callback_errors += 1
            log.exception("request %s: its on_done callback raised", r.request_id or hex(id(r)))

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
                        self._deliver(r, waiting_done)
                        break
        room = self.max_batch - len(self._running)
        joining, self._waiting = self._waiting[:room], self._waiting[room:]
        for r, done in joining:
            if not r.started:  # (admission starts every request: a caller's mistake, that request's alone)
                r.fail(ValueError("a request joins the engine after InFlight.start() (admit calls it)"), "joining")
                self._deliver(r, done)
        joining = [(r, done) for r, done in joining if r.fault is None]
        loop.add([r for r, _ in joining])
        self._running.update((id(r), (r, done)) for r, done in joining)
        self.peak_batch = max(self.peak_batch, len(self._running))
        return True
