"""A thread-safe LRU cache bounded in bytes, that compiles each key once even under concurrency."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Generic, TypeVar

__all__ = ["ByteLRU"]

V = TypeVar("V")


class ByteLRU(Generic[V]):
    """Least-recently-used cache whose bound is the total ``size(value)`` in bytes, and at most
    ``max_entries`` values (default None: no bound but the bytes; for values whose size is a lower bound).

    ``get_or_create(key, create)`` runs ``create`` once per key: a second thread
    asking for a key being created waits for that result (or its exception,
    which is not cached). A value larger than the whole bound is returned but not kept.
    """

    def __init__(self, max_bytes: int, size: Callable[[V], int], max_entries: int | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if max_entries is not None and max_entries < 1:
            raise ValueError(f"max_entries must be positive (or None), got {max_entries}")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._size = size
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._pending: dict[Hashable, Future[V]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._items

    def get(self, key: Hashable) -> V | None:
        """The value kept for ``key`` (counted a hit, and made the most recently used), or None (not
        counted: a miss is counted by the :meth:`get_or_create` that follows)."""
        with self._lock:
            if key not in self._items:
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return self._items[key][0]

    def get_or_create(self, key: Hashable, create: Callable[[], V]) -> V:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key][0]
            pending = self._pending.get(key)
            if pending is None:
                self.misses += 1
                mine: Future[V] = Future()
                self._pending[key] = mine
        if pending is not None:
            return pending.result()
        try:
            value = create()
        except BaseException as err:
            with self._lock:
                del self._pending[key]
            mine.set_exception(err)
            raise
        with self._lock:
            del self._pending[key]
            self._insert(key, value)
        mine.set_result(value)
        return value

    def _insert(self, key: Hashable, value: V) -> None:
        nbytes = self._size(value)
        if nbytes > self.max_bytes:
            return
        self._items[key] = (value, nbytes)
        self._bytes += nbytes
        while self._bytes > self.max_bytes or (self.max_entries is not None and len(self._items) > self.max_entries):
            _, (_, freed) = self._items.popitem(last=False)
            self._bytes -= freed

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0
