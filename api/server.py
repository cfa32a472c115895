"""The API's uvicorn server (:class:`Server`, which `meridian serve` runs), and serving it from a background thread
(the demo and the tests use :func:`serve_in_thread`)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from meridian.api.app import create_app
from meridian.service.core import MeridianService


class Server(uvicorn.Server):
    """uvicorn's server for an app of :func:`create_app`: told to exit, it first ends the app's open event and log
    streams. uvicorn waits for every connection to close, and a stream of a job still running never closed by
    itself: ``meridian serve`` with one client following a job had not stopped 20 s after its Ctrl-C (a systemd
    stop waits for its SIGKILL). A stream's client resumes once the service is back (events by ``Last-Event-ID``)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.stopping: threading.Event = config.app.state.stopping

    def handle_exit(self, sig: int, frame: Any) -> None:  # the signal handler (SIGINT, SIGTERM)
        self.stopping.set()
        super().handle_exit(sig, frame)

    def stop(self) -> None:
        """Exit from another thread, as a signal would."""
        self.stopping.set()
        self.should_exit = True


@contextmanager
def serve_in_thread(service: MeridianService, *, host: str = "127.0.0.1", port: int = 0,
                    start_timeout_s: float = 30.0, **app_options: Any) -> Iterator[str]:
    """Run uvicorn for an already-started service; yields the base URL and stops the server on exit.
    ``app_options`` go to :func:`create_app` (e.g. ``auth``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    url = f"http://{host}:{sock.getsockname()[1]}"
    server = Server(uvicorn.Config(create_app(service.config, service=service, **app_options), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="meridian-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the API server did not start on {url} within {start_timeout_s:.0f} s")
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.stop()
        thread.join(timeout=10)
        sock.close()
