"""Running an app under uvicorn on a socket bound beforehand: the CLI learns at once whether the
port is free (a clear error instead of a traceback), and port 0 picks a free one."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from blocktrain.errors import ConfigError


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port)."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} must lie in 0..65535")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # proto = IPPROTO_TCP, not 0: asyncio switches Nagle off (TCP_NODELAY) only on sockets
        # that say they are TCP, and with Nagle on, a response written in two parts waits for
        # the client's delayed ACK: 40 ms per request on loopback.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); "
            "choose another --port or --host"
        ) from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def run(app: FastAPI, sock: socket.socket) -> None:
    """Serve until interrupted (blocking)."""
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30)
    uvicorn.Server(config).run(sockets=[sock])


@dataclass
class ThreadedServer:
    """A uvicorn server in a background thread (tests and benchmarks on loopback)."""

    server: uvicorn.Server
    thread: threading.Thread
    url: str

    @classmethod
    def start(cls, app: FastAPI, sock: socket.socket, timeout_s: float = 10.0) -> ThreadedServer:
        config = uvicorn.Config(app, log_level="warning", access_log=False)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return cls(server, thread, url_of(sock))

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
