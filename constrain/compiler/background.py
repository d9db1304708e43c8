"""Compiling within a time budget, on a thread of its own, and the bound on compiles that outrun it.

A Python thread cannot be stopped, and the engines compile in native code that polls for no
cancellation: a compile past its ``timeout_s`` runs to its end on its thread (a *runaway*), and its result
goes to the compile cache, so a retry of the same constraint is a cache hit. What is bounded is how
many runaways may run at once (:data:`MAX_RUNAWAY_COMPILES`): at the bound, a compile with a budget is
refused at once (:class:`~constrain.errors.CompileError`, saying so), without a thread, until a runaway
ends. The figures are reported as ``"compile.runaway"`` in :func:`constrain.caches.stats`.

The bound counts compiles once they are past their budget: compiles admitted while under it and still
within theirs may join it, so at most the bound minus one plus the compiles with a budget in flight at
that moment run away; then every new one is refused until they drain.

Decided against: a cancel flag checked between the passes of a compile (preparation, the engine's
compile, the value checks). The engine's compile is nearly all of the time, so the flag would stop
little, and it would throw away the grammar that a retry would find cached.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from constrain import caches
from constrain.errors import CompileError

__all__ = [
    "MAX_RUNAWAY_COMPILES", "MAX_UPGRADES", "RunawayCompiles", "alongside", "at_low_priority", "in_background",
    "runaway_compiles", "upgrades",
]  # fmt: skip

T = TypeVar("T")
U = TypeVar("U")

MAX_RUNAWAY_COMPILES = 4
"""Compiles past their ``timeout_s`` that may still run at once; at the bound, a compile with a budget is
refused until one ends. Each holds a thread, a core while it compiles, and its grammar's memory."""


class RunawayCompiles:
    """Compiles running on threads of their own within a time budget, and those past it (runaways),
    bounded by ``bound``; thread-safe. :meth:`run` runs one; :meth:`stats` gives the figures."""

    def __init__(self, bound: int) -> None:
        if bound < 1:
            raise ValueError(f"the bound on runaway compiles must be positive, got {bound}")
        self.bound = bound
        self._lock = threading.Lock()
        self._in_flight = 0  # within their budget, their caller waiting
        self._running = 0  # past their budget, still running
        self._in_time = 0  # ever ended within their budget
        self._timed_out = 0  # ever past their budget
        self._refused = 0  # ever refused at the bound

    def run(self, work: Callable[[], T], timeout_s: float) -> T:
        """``work()`` on a thread of its own, waited for ``timeout_s`` seconds (counted from this call).

        Raises
        ------
        CompileError
            :attr:`bound` runaways are running (nothing is started), or ``work`` ran past ``timeout_s``
            (it goes on running: a runaway until it ends).
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._running >= self.bound:
                self._refused += 1
                running = self._running
                raise CompileError(
                    f"{running} compiles that ran past their time budget are still running, the most allowed "
                    f"(MAX_RUNAWAY_COMPILES = {self.bound}): no compile with a budget starts until one of them ends"
                )
            self._in_flight += 1
        future: Future[T] = Future()
        late = False  # past its budget: counted in _running until it ends
        ended = False

        def target() -> None:
            nonlocal ended
            try:
                future.set_result(work())
            except BaseException as err:  # handed to the caller
                future.set_exception(err)
            finally:
                with self._lock:
                    ended = True
                    if late:
                        self._running -= 1

        try:
            threading.Thread(target=target, name="constrain-compile", daemon=True).start()
            future.exception(timeout=max(0.0, deadline - time.monotonic()))  # waits: the result comes below
        except FutureTimeout as err:
            with self._lock:
                if not ended:
                    late = True
                    self._running += 1
                    self._timed_out += 1
            if late:
                raise CompileError(
                    f"compiling took longer than the budget of {timeout_s:g} s (it goes on in the background, "
                    "and its result is cached)"
                ) from err
        finally:
            with self._lock:
                self._in_flight -= 1
        with self._lock:
            self._in_time += 1  # ended within its budget (or as it ran out, before the caller looked)
        return future.result()

    def stats(self) -> dict[str, int]:
        """``entries``: runaways running now; ``maxsize``: the bound; ``in_flight``: compiles within their
        budget now. Since the process started: ``hits``, compiles that ended within their budget (with a
        grammar or an error); ``misses``, those that ran past it; ``refused``, those refused at the bound."""
        with self._lock:
            return {
                "entries": self._running, "maxsize": self.bound, "in_flight": self._in_flight,
                "hits": self._in_time, "misses": self._timed_out, "refused": self._refused,
            }  # fmt: skip


runaway_compiles = RunawayCompiles(MAX_RUNAWAY_COMPILES)
"""The process's compiles with a time budget (:func:`in_background`)."""

MAX_UPGRADES = 2
"""xgrammar compiles past :attr:`~constrain.compiler.routing.AutoLimits.xgrammar_wait_s` that may still
run at once, while llguidance serves their constraints; at the bound, no more are started."""

upgrades = RunawayCompiles(MAX_UPGRADES)
"""The process's xgrammar compiles that ``engine="auto"`` waits for a while (its runaways: those past it)."""


def at_low_priority(work: Callable[[], T]) -> Callable[[], T]:
    """``work`` to be run on a thread of its own at the lowest CPU priority (on Linux: that thread's nice
    value 19, which the engine's compile threads it starts inherit), so that it takes what the requests
    being served leave. Elsewhere, ``work`` as it is."""

    def run() -> T:
        with contextlib.suppress(AttributeError, OSError):  # no per-thread priority here
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return work()

    return run


def _figures() -> dict[str, int]:
    return runaway_compiles.stats()  # whichever instance is the process's now (tests swap it)


caches.register("compile.runaway", _figures)
caches.register("compile.upgrades", upgrades.stats)


def in_background(work: Callable[[], T], timeout_s: float) -> T:
    """``work()`` within ``timeout_s`` seconds, by :data:`runaway_compiles` (see :meth:`RunawayCompiles.run`)."""
    return runaway_compiles.run(work, timeout_s)


_beside = ThreadPoolExecutor(thread_name_prefix="constrain-native")
"""Threads for :func:`alongside` (Python's default count: the machine's cores plus 4, at most 32)."""


def alongside(native: Callable[[], T], python: Callable[[], U]) -> tuple[T, U]:
    """``native()`` on a pool thread while ``python()`` runs on this one: both results.

    For a native call that releases the GIL (llguidance's compile does; xgrammar's keeps every core busy
    on its own): its time and ``python``'s then overlap on a second core. Where ``native`` raises, that is
    raised, once both have ended (``python``'s own exception, if any, dropped); else ``python``'s."""
    future = _beside.submit(native)
    try:
        mine = python()
    except Exception:
        future.result()  # native's error first: what the caller would have met calling them in turn
        raise
    return future.result(), mine
