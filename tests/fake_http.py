"""A misbehaving HTTP server on loopback, for testing clients: it reads each request whole and then lets
a test's handler write whatever raw bytes it likes (a trickle, a flood, a reset, malformed JSON)."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from typing import Any, Callable


class FakeServer:
    """``with FakeServer(handler) as srv:`` serves ``srv.url``; each request runs ``handler(srv, conn, body)``
    in its own thread (the connection is closed after it). ``srv.bodies`` holds the request bodies as JSON,
    ``srv.sent`` the bytes the handlers wrote, ``srv.stop`` is set when the server closes.
    ``read_request=False``: the handler gets the connection as it is accepted (``body`` empty)."""

    def __init__(self, handler: Callable[["FakeServer", socket.socket, bytes], None], read_request: bool = True):
        self.handler, self.read_request = handler, read_request
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.bodies: list[Any] = []
        self.sent = 0
        self.stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def __enter__(self) -> "FakeServer":
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for thread in list(self._threads):
            thread.join(timeout=5)
        self.listener.close()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        try:
            if not self.read_request:
                return self.handler(self, conn, b"")
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, body = data.split(b"\r\n\r\n", 1)
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            while len(body) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                body += chunk
            if body:
                self.bodies.append(json.loads(body))
            self.handler(self, conn, body)
        except OSError:
            pass  # the client went away: what several tests make it do
        finally:
            conn.close()

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        with self._lock:
            self.sent += len(data)


def head(status: int = 200, headers: dict[str, str] | None = None, length: int | None = None) -> bytes:
    """A status line and headers (``length``: the Content-Length to declare, None for none)."""
    lines = [f"HTTP/1.1 {status} X", "Content-Type: application/json", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answer(body: bytes | str | Any, status: int = 200, headers: dict[str, str] | None = None) -> Callable:
    """A handler that sends ``body`` (bytes or text as they are, anything else as JSON) whole and correctly."""
    raw = body if isinstance(body, bytes) else body.encode() if isinstance(body, str) else json.dumps(body).encode()

    def handler(srv: FakeServer, conn: socket.socket, request: bytes) -> None:
        srv.send(conn, head(status, headers, len(raw)) + raw)

    return handler


def trickle(declared: int = 1000, every: float = 0.5, in_headers: bool = False) -> Callable:
    """A handler that sends one byte each ``every`` seconds: of the headers (``in_headers``), or of a body
    of ``declared`` bytes after a complete head, until the client leaves or the server stops."""

    def handler(srv: FakeServer, conn: socket.socket, request: bytes) -> None:
        data = head(length=declared) + b"1" * declared
        if not in_headers:
            srv.send(conn, data[: len(head(length=declared))])
            data = data[len(head(length=declared)):]
        for i in range(len(data)):
            if srv.stop.wait(every):
                return
            srv.send(conn, data[i : i + 1])

    return handler


def flood(declared: int | None, chunked: bool = False) -> Callable:
    """A handler that streams bytes as fast as the client takes them, declaring ``declared`` bytes (None:
    no length, the reply ends at the close; ``chunked``: chunked encoding), until the client leaves."""

    def handler(srv: FakeServer, conn: socket.socket, request: bytes) -> None:
        srv.send(conn, head(length=declared, headers={"Transfer-Encoding": "chunked"} if chunked else None))
        block = b"[" + b"0," * 32767 + b"0"  # the opening of a valid-looking JSON array
        frame = (f"{len(block):x}\r\n".encode() + block + b"\r\n") if chunked else block
        deadline = time.monotonic() + 30
        while not srv.stop.is_set() and time.monotonic() < deadline:
            srv.send(conn, frame)

    return handler


def reset(after: bytes = b"") -> Callable:
    """A handler that sends ``after`` and then resets the connection (RST, not a clean close)."""

    def handler(srv: FakeServer, conn: socket.socket, request: bytes) -> None:
        if after:
            srv.send(conn, after)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    return handler
