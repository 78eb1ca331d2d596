"""Running the app: on the main thread (``rtrace serve``) or on one of its own (the collector's).

uvicorn serves the ASGI app on a socket this module binds (so port 0 works and the real
port is known before the first request). TLS: a certificate and key, as the collector's.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

__all__ = ["ViewerServer"]

logger = logging.getLogger("rtrace")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class ViewerServer:
    """An HTTP(S) server for the viewer app on ``host:port`` (0: a free port)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, tls_cert: str | None = None,
                 tls_key: str | None = None, sources: Any = None) -> None:
        import uvicorn

        self.sources = sources
        self.sock = _bind(host, port)
        self.host = host
        self.port = self.sock.getsockname()[1]
        self.tls = tls_cert is not None
        config = uvicorn.Config(app, log_level="warning", access_log=False, ssl_certfile=tls_cert,
                                ssl_keyfile=tls_key, lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host.strip('[]')}]"
        if host in ("0.0.0.0", "[::]"):
            host = "<this host's address>"
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/"

    def run(self) -> None:
        """Serve until SIGINT / SIGTERM (uvicorn's handlers) on this thread."""
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self._close()

    def start(self, timeout_s: float = 15.0) -> "ViewerServer":
        """Serve on a thread of its own; returns once it accepts connections."""
        # uvicorn installs its signal handlers on the main thread only: the program's own stay
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="rtrace-serve", daemon=True)
        self._thread.start()
        deadline = threading.Event()
        for _ in range(int(timeout_s / 0.02)):
            if self.server.started or not self._thread.is_alive():
                break
            deadline.wait(0.02)
        if not self.server.started:
            self.stop()
            raise RuntimeError(f"rtrace serve: the viewer did not start on {self.host}:{self.port}")
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving (open connections get ``timeout_s``) and the runs' refresh."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._close()

    def _close(self) -> None:
        try:
            self.sock.close()
        except OSError:  # pragma: no cover
            pass
        if self.sources is not None:
            self.sources.close()
            self.sources = None
