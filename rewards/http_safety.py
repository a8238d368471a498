"""What every flowalign HTTP server (``serve-judge``, and any scoring server built the same way) needs
before it answers anyone: a bearer key, bounded request bodies, bounded time per connection and
bounded decoded pixels, with errors in OpenAI's shape.

* :class:`Limits`: the bounds (body bytes, header and body seconds, pixels per image and per request).
* :func:`guard`: ASGI middleware. It checks ``Authorization: Bearer KEY`` (constant-time) → 401,
  refuses a declared ``Content-Length`` over the cap → 413 *before reading the body*, reads the body
  itself under the byte cap (chunked uploads too) → 413 and under a deadline → 408, then hands the
  complete body to the app. ``/health`` needs no key (for load balancers).
* :func:`uvicorn_config`: uvicorn settings whose connections must send their request headers within
  ``header_timeout_s`` (uvicorn alone waits for a trickling client forever) → 408 and closed.
* :func:`open_image`: decode an uploaded image only after its header says its pixel count fits
  (:class:`PixelBudget`): a 164 KB PNG that declares 13000×13000 pixels is refused unread.
* :func:`check_bind`: refuses to listen beyond loopback without a key; :func:`add_safety_flags` and
  :func:`limits_from`: the command-line flags for all of it.

Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with the status that names it.
"""

from __future__ import annotations

import asyncio
import hmac
import io
import ipaddress
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from flowalign.errors import UserError

#: the environment variable a server reads its key from, and a client sends it from
API_KEY_ENV = "FLOWALIGN_API_KEY"
#: formats an upload may be in (PIL's other decoders are never reached by untrusted bytes)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class BadRequest(Exception):
    """A request the server refuses, with the HTTP ``status`` (400 unless given) and the ``param`` it names."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@dataclass(frozen=True)
class Limits:
    """Bounds on what one request may cost the server.

    ``api_key``: None serves without authentication (loopback only, see :func:`check_bind`).
    """

    api_key: str | None = None
    max_body_bytes: int = 32 * 2**20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_image_pixels: int = 4096 * 4096
    max_request_pixels: int = 4 * 4096 * 4096
    #: connections served at once (more are answered 503); bounds memory to ~ this × max_body_bytes
    max_connections: int = 64
    #: the command whose flags the refusals name (``serve-judge --max-body-mb``, ``serve-reward ...``)
    command: str = "serve-judge"


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
          503: "server_overloaded", 500: "server_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object for ``status``."""
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def _error_response(status: int, message: str, code: str | None = None) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]  # the unread rest of the request must not be parsed as the next one
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="flowalign"'))
    return headers, body


def key_matches(header: bytes | None, key: str) -> bool:
    """``header`` is ``Bearer <key>`` (compared in constant time: a wrong key's timing tells nothing)."""
    expected = b"Bearer " + key.encode()
    return header is not None and hmac.compare_digest(header.strip(), expected)


def guard(app: Callable, limits: Limits) -> Callable:
    """``app`` behind authentication, the body cap and the body deadline (see the module docstring)."""

    async def guarded(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def refuse(status: int, message: str, code: str | None = None) -> None:
            headers, body = _error_response(status, message, code)
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        headers = dict(scope["headers"])
        if limits.api_key is not None and scope["path"] != "/health" \
                and not key_matches(headers.get(b"authorization"), limits.api_key):
            return await refuse(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                                     f"(the key the server was started with, e.g. from ${API_KEY_ENV})",
                                "invalid_api_key")
        too_large = (f"request body over the server's limit of {limits.max_body_bytes} bytes "
                     f"({limits.command} --max-body-mb); send fewer or smaller images")
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            return await refuse(400, "Content-Length is not an integer")
        if declared > limits.max_body_bytes:
            return await refuse(413, too_large, "request_too_large")
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.body_timeout_s
        more = True
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return await refuse(408, f"the request body did not arrive within {limits.body_timeout_s:g} s "
                                         f"({limits.command} --body-timeout)", "request_timeout")
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limits.max_body_bytes:
                return await refuse(413, too_large, "request_too_large")
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, whenever it comes

        return await app(scope, replay, send)

    return guarded


def uvicorn_config(app: Any, limits: Limits, **kwargs: Any) -> Any:
    """A ``uvicorn.Config`` serving ``guard(app, limits)`` whose connections must deliver each request's
    headers within ``limits.header_timeout_s`` (from connecting, or from the previous reply on a kept-alive
    connection); a slower client gets 408 and is disconnected."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    headers, body = _error_response(408, f"the request headers did not arrive within {limits.header_timeout_s:g} s "
                                         f"({limits.command} --header-timeout)", "request_timeout")
    too_slow = b"HTTP/1.1 408 Request Timeout\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"\r\n" + body

    class HeaderDeadline(H11Protocol):
        """uvicorn's h11 protocol plus a deadline on the headers (its keep-alive timer restarts on every
        byte received, so a client sending one byte a second would hold the connection forever)."""

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._seen_cycle, self._header_timer = None, None
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request is being answered (its body has its own deadline)
            if not self.transport.is_closing():
                self.transport.write(too_slow)
                self.transport.close()

        def _note_request(self) -> None:
            if self.cycle is not None and self.cycle is not self._seen_cycle:  # a new request's headers are in
                self._seen_cycle = self.cycle
                self._disarm()  # from here the body deadline (guard) applies

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._note_request()

        def on_response_complete(self) -> None:
            self._arm()  # for the next request on this kept-alive connection; armed first because
            super().on_response_complete()  # a pipelined request already received starts in here
            self._note_request()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return uvicorn.Config(guard(app, limits), http=HeaderDeadline, limit_concurrency=limits.max_connections,
                          timeout_keep_alive=5, **kwargs)


class PixelBudget:
    """Decoded pixels left to one request (``limits.max_request_pixels``), each image at most
    ``limits.max_image_pixels``."""

    def __init__(self, limits: Limits):
        self.per_image, self.left, self.total = limits.max_image_pixels, limits.max_request_pixels, limits.max_request_pixels

    def take(self, width: int, height: int, frames: int, where: str) -> None:
        pixels = width * height * frames
        if pixels > self.per_image:
            raise BadRequest(f"{where}: {width}x{height}" + (f"x{frames} frames" if frames > 1 else "")
                             + f" = {pixels} pixels, over the server's limit of {self.per_image} per image;"
                             " send a smaller image", param=where)
        if pixels > self.left:
            raise BadRequest(f"{where}: the request's images hold over {self.total} pixels in all (the server's "
                             "limit per request); send fewer or smaller images", param=where)
        self.left -= pixels


def open_image(raw: bytes, budget: PixelBudget, where: str) -> Any:
    """Encoded image bytes → PIL RGB image, decoded only once its header's size fits ``budget``
    (every frame of an animated image counts; only the first is decoded)."""
    from PIL import Image, UnidentifiedImageError

    try:
        # open() reads the header only; PIL's own bomb check (DecompressionBombError) guards this step
        image = Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)
        budget.take(image.width, image.height, 1, where)
        return image.convert("RGB")  # decodes the first frame only
    except Image.DecompressionBombError as e:
        raise BadRequest(f"{where}: too many pixels ({e}); send a smaller image", param=where) from e
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise BadRequest(f"{where} does not hold a readable {'/'.join(IMAGE_FORMATS)} image ({e})", param=where) from e


def is_loopback(host: str) -> bool:
    """Whether ``host`` only listens to this machine (a name other than ``localhost`` counts as reachable)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_api_key(flag: str | None) -> str | None:
    """The key from ``--api-key`` or ``$FLOWALIGN_API_KEY`` (empty counts as none)."""
    key = flag if flag is not None else os.environ.get(API_KEY_ENV)
    return key or None


def add_safety_flags(parser: Any) -> None:
    """The flags every server command takes: the key and the bounds of :class:`Limits`."""
    d = Limits()
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; prefer the variable: "
                             "a flag shows in the process list). Required with a --host beyond loopback")
    parser.add_argument("--insecure-no-auth", action="store_true",
                        help="serve a --host beyond loopback without a key (only on a network you trust)")
    parser.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / 2**20,
                        help="largest request body in MiB; a larger one gets 413 before it is read")
    parser.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels,
                        help="largest image (width x height) a request may send; checked before decoding")
    parser.add_argument("--max-request-pixels", type=int, default=d.max_request_pixels,
                        help="most pixels of all the images of one request together")
    parser.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                        help="seconds a client has to send its request headers (then 408, disconnected)")
    parser.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                        help="seconds a client has to send its request body (then 408)")
    parser.add_argument("--max-connections", type=int, default=d.max_connections,
                        help="connections served at once; more are answered 503")


def limits_from(args: Any, command: str) -> Limits:
    """:class:`Limits` from :func:`add_safety_flags`' flags (each checked, ``UserError`` naming the flag);
    refuses a ``--host`` beyond loopback without a key (:func:`check_bind`)."""
    for flag, value in (("--max-body-mb", args.max_body_mb), ("--max-image-pixels", args.max_image_pixels),
                        ("--max-request-pixels", args.max_request_pixels), ("--header-timeout", args.header_timeout),
                        ("--body-timeout", args.body_timeout), ("--max-connections", args.max_connections)):
        if not math.isfinite(value) or value <= 0:
            raise UserError(f"{command} {flag} {value}: give a number > 0")
    key = resolve_api_key(args.api_key)
    check_bind(args.host, key, args.insecure_no_auth, command)
    return Limits(api_key=key, max_body_bytes=int(args.max_body_mb * 2**20), header_timeout_s=args.header_timeout,
                  body_timeout_s=args.body_timeout, max_image_pixels=args.max_image_pixels,
                  max_request_pixels=args.max_request_pixels, max_connections=args.max_connections, command=command)


def check_bind(host: str, api_key: str | None, insecure_no_auth: bool, command: str) -> None:
    """Refuse (``UserError``) to listen beyond loopback without a key, unless explicitly told to."""
    if api_key is None and not insecure_no_auth and not is_loopback(host):
        raise UserError(f"{command} --host {host} would serve anyone who can reach this machine without a key: "
                        f"set ${API_KEY_ENV} (or --api-key), or pass --insecure-no-auth on a trusted network")


def read_reply(session: Any, method: str, url: str, body: Any, headers: dict[str, str],
               timeout: float) -> tuple[int, Any, bytes]:
    """``(status, headers, body)`` of one request whose whole reply must arrive within ``timeout`` seconds
    (the clients' side: a server that trickles its reply cannot stall a training step). Raises
    ``TimeoutError`` when it does not, and ``requests``' ``ConnectionError`` / ``Timeout`` as they come."""
    deadline = time.monotonic() + timeout
    r = session.request(method, url, json=body, headers=headers, stream=True, timeout=(timeout, timeout))
    chunks = []
    for chunk in r.iter_content(65536):
        chunks.append(chunk)
        if time.monotonic() > deadline:
            r.close()
            raise TimeoutError(f"no complete reply within timeout={timeout:g} s")
    return r.status_code, r.headers, b"".join(chunks)
