"""Every cache of ``constrain``, bounded and reported: a registry that :func:`constrain.cache_stats` reads.

A memoized function is declared with :func:`bounded` (``functools.lru_cache`` with a
bound, registered under a name); a cache of another kind registers a function
that returns its figures (:func:`register`). Names are ``"module.what"``.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["bounded", "machine_memory", "register", "stats"]

F = TypeVar("F", bound=Callable[..., Any])

_registry: dict[str, Callable[[], dict[str, int]]] = {}
_lock = threading.Lock()


def register(name: str, figures: Callable[[], dict[str, int]]) -> None:
    """Report the cache ``name`` by calling ``figures()`` (at least ``entries`` and ``maxsize``).

    Raises ``ValueError`` if ``name`` is taken.
    """
    with _lock:
        if name in _registry:
            raise ValueError(f"a cache named {name!r} is registered already: name caches 'module.what'")
        _registry[name] = figures


def bounded(name: str, maxsize: int, *, serial: bool = False) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)``, reported under ``name`` (entries, hits, misses, maxsize).

    ``serial``: one call at a time, so that a value two threads ask for at once is built once (for builds
    of tens of milliseconds that a background thread may be making: the second caller waits for it). The
    function keeps ``cache_info`` and ``cache_clear``."""
    if maxsize < 1:
        raise ValueError(f"a cache's maxsize must be positive, got {maxsize}")

    def wrap(function: F) -> F:
        cached = functools.lru_cache(maxsize=maxsize)(function)

        def figures() -> dict[str, int]:
            info = cached.cache_info()
            return {"entries": info.currsize, "hits": info.hits, "misses": info.misses, "maxsize": maxsize}

        register(name, figures)
        if not serial:
            return cached  # type: ignore[return-value]
        lock = [threading.Lock()]  # a child forked during a build gets one of its own (the builder is gone)
        if hasattr(os, "register_at_fork"):  # (POSIX)
            os.register_at_fork(after_in_child=lambda: lock.__setitem__(0, threading.Lock()))

        @functools.wraps(function)
        def one_at_a_time(*args: Any, **kwargs: Any) -> Any:
            with lock[0]:
                return cached(*args, **kwargs)

        one_at_a_time.cache_info = cached.cache_info  # type: ignore[attr-defined]
        one_at_a_time.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        return one_at_a_time  # type: ignore[return-value]

    return wrap


_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
"""Where a container's memory limit is read (cgroup v2, then v1); "max" or a huge number means none."""


def machine_memory() -> int | None:
    """Bytes of memory this process may use: the machine's physical memory, or the container's memory
    limit where smaller; None where it cannot be read. What caches sized to the machine take a share of."""
    try:
        found = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        return None
    for path in _CGROUP_LIMITS:
        try:
            limit = path.read_text().strip()
        except OSError:
            continue
        if limit.isdigit():
            found = min(found, int(limit))
    return found if found > 0 else None


def stats() -> dict[str, dict[str, int]]:
    """Every registered cache's figures, by name."""
    with _lock:
        found = dict(_registry)
    return {name: figures() for name, figures in sorted(found.items())}
