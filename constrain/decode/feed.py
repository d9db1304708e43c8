"""A worker thread's output, handed to the caller's thread as it comes: what ``stream()`` iterates."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Feed"]

T = TypeVar("T")


class Feed(Generic[T]):
    """Items a worker thread produces, handed to the caller's thread as they come."""

    def __init__(self) -> None:
        self._items: queue.SimpleQueue[tuple[T] | None] = queue.SimpleQueue()  # None: the work ended

    def put(self, item: T) -> None:
        """Hand ``item`` over (from any thread)."""
        self._items.put((item,))

    def run(self, work: Callable[[threading.Event], None]) -> Iterator[T]:
        """Run ``work(cancelled)`` on a daemon thread and yield what it puts, as it puts it; then raise
        what it raised, if anything. Closing the iterator early (or its garbage collection) sets
        ``cancelled``, for the work to stop soon after."""
        failure: list[BaseException] = []
        cancelled = threading.Event()

        def worker() -> None:
            try:
                work(cancelled)
            except BaseException as err:
                failure.append(err)
            finally:
                self._items.put(None)

        threading.Thread(target=worker, name="constrain-stream", daemon=True).start()
        try:
            while (box := self._items.get()) is not None:
                yield box[0]
        finally:  # the caller closed the iterator early (or it was collected): stop the work for nobody
            cancelled.set()
        if failure:
            raise failure[0]
