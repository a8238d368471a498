"""One HTTP request whose whole reply is bounded in time and in size: the transport of the ``remote``
reward and of the ``vlm_judge_http`` judge, which run inside a training process and must never be
stalled or flooded by the server they call.

``requests``' ``timeout`` bounds each socket read, not the reply: a server that sends a
``Content-Length`` and then one byte a second keeps every read short, so a ``timeout=3`` call lasted
40 s. Here the connection's socket carries the call's deadline and gives each blocking operation
(connect, TLS handshake, every send and every receive, however the HTTP parser above batches them)
only the time left until it, so a call returns within ``timeout`` plus scheduling however the server
behaves (only the name lookup before connecting is not bounded). The reply is read in chunks and
counted: a declared ``Content-Length`` over ``max_bytes`` is refused unread, and an undeclared or
chunked body is cut off once it passes ``max_bytes``.

Each call opens its own connection and closes it. Replies are asked uncompressed (no gzip bomb). TLS
is verified against ``$REQUESTS_CA_BUNDLE`` / ``$CURL_CA_BUNDLE`` or certifi's bundle, as ``requests``
does; proxy variables are not read (the servers these clients call sit on the cluster's own network).

Every failure is a :class:`ReplyError` whose text is one line; nothing else escapes :func:`request`.
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

#: the size of one read from the socket
_CHUNK = 64 * 1024


class ReplyError(Exception):
    """No usable reply. ``retryable``: a transport failure (unreachable, reset, too slow), which another
    attempt may get past; False for a reply that arrived but is unusable (too large, malformed)."""

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(one_line(message, 500))
        self.retryable = retryable


@dataclass(frozen=True)
class Reply:
    """A complete reply: ``status``, ``headers`` (names case-insensitive) and the ``body`` bytes."""

    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self) -> Any:
        """The body as JSON (:func:`loads`)."""
        return loads(self.body)

    def error_message(self) -> str:
        """The server's error message: ``error.message`` of an OpenAI-shaped error, else the body's start."""
        try:
            message = loads(self.body)["error"]["message"]
            if isinstance(message, str):
                return one_line(message, 300)
        except (ReplyError, KeyError, TypeError):
            pass
        return one_line(self.body[:300].decode("utf-8", "replace"), 300) or "(empty reply)"


def one_line(text: str, limit: int) -> str:
    """``text`` on one line of at most ``limit`` characters (a server's text goes into logs and warnings)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def loads(data: bytes) -> Any:
    """JSON ``data`` → Python, or :class:`ReplyError` saying why not (bad UTF-8, bad syntax, nesting so
    deep that Python's parser gives up). ``NaN`` / ``Infinity`` and numbers past the float range are read
    as non-finite floats: the callers' validators refuse or mask them."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ReplyError("the reply is not usable JSON (nested too deeply)") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError and too-long integers are ValueErrors
        raise ReplyError(f"the reply is not JSON ({e})") from None


class _Deadline:
    """Every blocking call of the socket waits at most until ``deadline`` (``time.monotonic()``): the
    timeout is reset to the time left before each one, so no sequence of them outlasts the deadline."""

    deadline: float | None = None

    def _arm(self) -> None:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the deadline has passed")
            self.settimeout(left)  # type: ignore[attr-defined]

    def recv_into(self, *args: Any, **kwargs: Any) -> int:
        self._arm()
        return super().recv_into(*args, **kwargs)  # type: ignore[misc]

    def recv(self, *args: Any, **kwargs: Any) -> bytes:
        self._arm()
        return super().recv(*args, **kwargs)  # type: ignore[misc]

    def send(self, *args: Any, **kwargs: Any) -> int:
        self._arm()
        return super().send(*args, **kwargs)  # type: ignore[misc]

    def sendall(self, *args: Any, **kwargs: Any) -> None:
        self._arm()  # the timeout of sendall bounds the whole call (Python >= 3.5)
        return super().sendall(*args, **kwargs)  # type: ignore[misc]


class _DeadlineSocket(_Deadline, socket.socket):
    pass


class _DeadlineSSLSocket(_Deadline, ssl.SSLSocket):
    pass  # SSLSocket.sendall loops over send, and recv / recv_into are what the HTTP parser's buffer calls


@functools.lru_cache(maxsize=1)
def _tls_context() -> ssl.SSLContext:
    cafile = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
    if not cafile:
        try:
            import certifi

            cafile = certifi.where()
        except ImportError:  # the system's store
            cafile = None
    context = ssl.create_default_context(cafile=cafile)
    context.sslsocket_class = _DeadlineSSLSocket
    return context


class _Connection(http.client.HTTPConnection):
    """An HTTP(S) connection whose socket keeps ``deadline`` (see :class:`_Deadline`)."""

    def __init__(self, host: str, port: int | None, tls: bool, deadline: float):
        self.default_port = 443 if tls else 80  # read by __init__ (the port) and by the Host header
        super().__init__(host, port, timeout=max(deadline - time.monotonic(), 1e-3))
        self.tls, self.deadline = tls, deadline

    def connect(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline has passed")
        raw = socket.create_connection((self.host, self.port), left)
        sock: socket.socket = _DeadlineSocket(raw.family, raw.type, raw.proto, fileno=raw.detach())
        sock.settimeout(max(self.deadline - time.monotonic(), 1e-3))  # the handshake's deadline too
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls:
            sock = _tls_context().wrap_socket(sock, server_hostname=self.host)
        sock.deadline = self.deadline  # type: ignore[attr-defined]
        self.sock = sock


def _describe(error: BaseException) -> str:
    """A transport error in words (the exception type is kept: it is what a user searches for)."""
    if isinstance(error, ConnectionRefusedError):
        return "connection refused (is the server running, on this host and port?)"
    if isinstance(error, socket.gaierror):
        return f"unknown host ({error})"
    if isinstance(error, http.client.IncompleteRead):
        return f"the connection closed in the middle of the reply ({len(error.partial)} bytes read)"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def request(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None, *,
            timeout: float, max_bytes: int) -> Reply:
    """``method url`` with ``body`` sent as JSON (None: no body); the whole exchange (connect, send, the
    complete reply) within ``timeout`` seconds and a reply body of at most ``max_bytes``.
    Raises :class:`ReplyError` (one line) on every failure, whatever the status; a non-200 reply is returned."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ReplyError(f"{url!r} is not an http(s):// URL")
    try:
        payload = None if body is None else json.dumps(body, allow_nan=False).encode()
    except (TypeError, ValueError) as e:  # NaN or an object JSON has no form for: a bug of the caller's, said so
        raise ReplyError(f"the request cannot be sent as JSON ({e})") from None
    try:
        port = parts.port
    except ValueError as e:
        raise ReplyError(f"{url!r}: {e}") from None
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    send_headers = {**(headers or {}), "Connection": "close"}
    if payload is not None:
        send_headers["Content-Type"] = "application/json"
    too_slow = f"timed out: no complete reply within timeout={timeout:g} s"
    deadline = time.monotonic() + timeout
    conn = _Connection(parts.hostname, port, parts.scheme == "https", deadline)
    try:
        conn.connect()
        try:
            conn.request(method, path, body=payload, headers=send_headers)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may have answered (413, 401) without reading the whole body: read its reply
        response = conn.getresponse()
        declared = response.getheader("Content-Length")
        if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
            raise ReplyError(f"the reply declares {int(declared)} bytes, over the client's cap of {max_bytes} "
                             "bytes; not read")
        chunks, size = [], 0
        while True:
            chunk = response.read(_CHUNK)
            if not chunk:
                break
            size += len(chunk)
            if size > max_bytes:
                raise ReplyError(f"the reply is over the client's cap of {max_bytes} bytes; stopped reading")
            chunks.append(chunk)
            if time.monotonic() > deadline:
                raise ReplyError(too_slow, retryable=True)
        if response.length:  # http.client ends a short Content-Length body quietly when read in chunks
            raise http.client.IncompleteRead(b"".join(chunks), response.length)
        return Reply(response.status, response.headers, b"".join(chunks))
    except ReplyError:
        raise
    except Exception as e:  # noqa: BLE001 - OSError, http.client's and ssl's errors: one line each, never a traceback
        if isinstance(e, TimeoutError) or time.monotonic() > deadline:
            raise ReplyError(too_slow, retryable=True) from None
        raise ReplyError(_describe(e), retryable=True) from None
    finally:
        conn.close()
