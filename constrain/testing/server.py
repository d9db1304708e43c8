"""The OpenAI-compatible server on a free loopback port, for tests and benchmarks.

The APIs in this module serve testing and measurement and are prone to change.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from constrain.serving.server import create_app

__all__ = ["LocalServer"]


class LocalServer:
    """The OpenAI-compatible server on a free loopback port, run by uvicorn in a daemon thread.

    ``url`` is its address; :meth:`stop` ends it. ``options`` go to :func:`constrain.serving.server.create_app`;
    ``RuntimeError`` when it has not started within ``start_timeout_s`` seconds (or its thread died).
    """

    def __init__(self, handle: Any, *, start_timeout_s: float = 60.0, **options: Any) -> None:
        self.app = create_app(handle, **options)
        self.model = handle.name
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:  # (uvicorn offers no start-up event to wait on)
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._socket.close()
                raise RuntimeError(f"the server did not start within {start_timeout_s:g} s (see the log above)")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()
