"""What every flowalign HTTP server (``serve-judge``, and any scoring server built the same way) needs
before it answers anyone: a bearer key, bounded request bodies, bounded time per connection and
bounded decoded pixels, with errors in OpenAI's shape.

* :class:`Limits`: the bounds (body bytes, header and body seconds, pixels per image and per request,
  decoded bytes across all requests, requests at once).
* :func:`guard`: ASGI middleware. It checks ``Authorization: Bearer KEY`` (constant-time) → 401,
  answers 503 beyond ``max_connections`` requests in progress (``/health`` always answers), refuses a
  declared ``Content-Length`` over the cap → 413 *before reading the body*, reads the body itself under
  the byte cap (chunked uploads too) → 413 and under a deadline → 408, then hands the complete body to
  the app; whatever the app raises comes back as a JSON 500. ``/health`` needs no key (for load balancers).
* :func:`uvicorn_config`: uvicorn settings whose connections must send their request headers within
  ``header_timeout_s`` (uvicorn alone waits for a trickling client forever) → 408 and closed; idle
  connections beyond ``max_connections`` are closed oldest first, so a crowd of half-open sockets cannot
  shut anyone out.
* :class:`PixelBudget` and :func:`peek_image`: an uploaded image is decoded only after its header says
  its pixel count fits one request's caps: a 164 KB PNG that declares 13000×13000 pixels is refused
  unread (413). :class:`DecodeBudget`: the bytes that the decoded samples of *all* requests in progress
  may hold together; a request waits for its share (503 if it does not come in time) before it decodes.
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
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from flowalign.cli.common import add_number
from flowalign.errors import UserError
from flowalign.limits import (MAX_CONNECTIONS, MAX_SERVER_BODY_MB, MAX_SERVER_DECODED_MB, MAX_SERVER_IMAGE_PIXELS,
                              MAX_SERVER_REQUEST_PIXELS, MAX_TIMEOUT_S)

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
    #: one largest image (a scoring model's working memory grows with the pixels it is handed: a pixel
    #: statistic takes ~100 bytes a pixel); ``remote``'s default 16 MiB requests hold at most a third of this
    max_request_pixels: int = 4096 * 4096
    #: bytes the decoded samples of all requests in progress may hold at once (:class:`DecodeBudget`)
    max_decoded_bytes: int = 2**30
    #: seconds a request waits for its share of ``max_decoded_bytes`` (then 503: busy, retry)
    decode_wait_s: float = 30.0
    #: requests in progress at once (more are answered 503; ``/health`` always answers), and idle
    #: connections kept open (the oldest idle one is closed for a newcomer). Memory is bounded by this ×
    #: ~3 × ``max_body_bytes`` for bodies (the bytes, the parsed JSON, the base64-decoded payload) plus
    #: ``max_decoded_bytes`` for decoded samples, plus the model's own working memory, which no cap here
    #: bounds
    max_connections: int = 64
    #: the command whose flags the refusals name (``serve-judge --max-body-mb``, ``serve-reward ...``)
    command: str = "serve-judge"


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
          503: "server_overloaded", 500: "server_error", 504: "timeout_error"}
#: paths answered however busy the server is (no body, no work: load balancers and operators)
ALWAYS_ANSWERED = ("/health",)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object for ``status``."""
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> Any:
    """:func:`error_body` as a FastAPI ``JSONResponse`` with ``status`` (fastapi is the servers' extra, so it is
    imported here only when a server runs)."""
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(status, message, param, code), status_code=status)


def answer_errors_as_json(app: Any) -> None:
    """Answer a :class:`BadRequest` with its status, an unknown path or a wrong method (starlette's
    ``HTTPException``) and any other exception a route lets through with :func:`error_body` (the exception's
    text, cut to 2000 characters), instead of starlette's plain-text pages."""
    from starlette.exceptions import HTTPException

    @app.exception_handler(BadRequest)
    async def bad_request(_: Any, e: BadRequest) -> Any:
        return error_response(e.status, str(e), e.param, e.code)

    @app.exception_handler(HTTPException)
    async def http_error(_: Any, e: HTTPException) -> Any:
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def unexpected(_: Any, e: Exception) -> Any:
        return error_response(500, f"{type(e).__name__}: {e}"[:2000])


async def decode_body(request: Any, decoded: DecodeBudget, decode: Callable[[bytes, Reservation], Any]) -> Any:
    """``(decode(body, reservation), reservation)``: the request's body decoded in a worker thread, the bytes it
    decodes to held in a fresh reservation of ``decoded`` (released here when decoding fails; a
    :class:`BadRequest` then answers through :func:`answer_errors_as_json`)."""
    from starlette.concurrency import run_in_threadpool

    raw = await request.body()
    reservation = decoded.open()
    try:
        return await run_in_threadpool(decode, raw, reservation), reservation
    except BaseException:
        reservation.release()
        raise


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
    """``app`` behind authentication, the request limit, the body cap and the body deadline, with
    anything the app raises answered as a JSON 500 (see the module docstring)."""
    in_progress = 0

    async def guarded(scope: dict, receive: Callable, send: Callable) -> None:
        nonlocal in_progress
        if scope["type"] != "http":
            return await app(scope, receive, send)
        if scope["path"] in ALWAYS_ANSWERED:
            return await _answered(app, scope, receive, send)
        if in_progress >= limits.max_connections:
            headers, body = _error_response(503, f"the server is answering {limits.max_connections} requests "
                                                 f"already ({limits.command} --max-connections); retry shortly",
                                            "server_busy")
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            return await send({"type": "http.response.body", "body": body})
        in_progress += 1
        try:
            return await _guarded(scope, receive, send)
        finally:
            in_progress -= 1

    async def _guarded(scope: dict, receive: Callable, send: Callable) -> None:

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

        return await _answered(app, scope, replay, send)

    return guarded


async def _answered(app: Callable, scope: dict, receive: Callable, send: Callable) -> None:
    """Run ``app``; if it raises before answering, answer a JSON 500 naming the error (never uvicorn's
    plain-text one), and log the traceback."""
    started = False

    async def tracked(message: dict) -> None:
        nonlocal started
        started = started or message["type"] == "http.response.start"
        await send(message)

    try:
        await app(scope, receive, tracked)
    except Exception as e:  # noqa: BLE001 - the server's own failure, reported to the client, then logged
        import logging

        logging.getLogger("flowalign.server").exception("request to %s failed", scope.get("path"))
        if not started:
            headers, body = _error_response(500, f"{type(e).__name__}: {e}"[:1000])
            await send({"type": "http.response.start", "status": 500, "headers": headers})
            await send({"type": "http.response.body", "body": body})


def uvicorn_config(app: Any, limits: Limits, **kwargs: Any) -> Any:
    """A ``uvicorn.Config`` serving ``guard(app, limits)`` whose connections must deliver each request's
    headers within ``limits.header_timeout_s`` (from connecting, or from the previous reply on a kept-alive
    connection); a slower client gets 408 and is disconnected."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    headers, body = _error_response(408, f"the request headers did not arrive within {limits.header_timeout_s:g} s "
                                         f"({limits.command} --header-timeout)", "request_timeout")
    too_slow = b"HTTP/1.1 408 Request Timeout\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"\r\n" + body
    #: connections with no request in progress, oldest first (dict order): the first closed for a newcomer
    idle: dict[Any, None] = {}

    class HeaderDeadline(H11Protocol):
        """uvicorn's h11 protocol plus a deadline on the headers (its keep-alive timer restarts on every
        byte received, so a client sending one byte a second would hold the connection forever)."""

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._seen_cycle, self._header_timer = None, None
            self._arm()
            self._idle()
            while len(idle) > limits.max_connections:  # half-open sockets must not shut newcomers out
                oldest = next(iter(idle))
                idle.pop(oldest)
                oldest._close_idle()

        def _idle(self) -> None:
            idle.pop(self, None)
            idle[self] = None

        def _close_idle(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self.transport.close()

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
                idle.pop(self, None)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._note_request()

        def on_response_complete(self) -> None:
            self._idle()
            self._arm()  # for the next request on this kept-alive connection; armed first because
            super().on_response_complete()  # a pipelined request already received starts in here
            self._note_request()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            idle.pop(self, None)
            super().connection_lost(exc)

    # no limit_concurrency: uvicorn's counts idle connections too and answers /health 503 beyond it; the
    # guard limits requests in progress instead, and idle connections are closed oldest first (above)
    return uvicorn.Config(guard(app, limits), http=HeaderDeadline, timeout_keep_alive=5, **kwargs)


def bind(config: Any) -> tuple[Any, int]:
    """The listening socket of a ``uvicorn.Config`` and the port it got (``--port 0``: a free one)."""
    sock = config.bind_socket()
    return sock, sock.getsockname()[1]


def url_host(host: str) -> str:
    """``host`` as it goes in a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class PixelBudget:
    """Decoded pixels left to one request (``limits.max_request_pixels``), each image at most
    ``limits.max_image_pixels``. Over either: 413, before anything is decoded."""

    def __init__(self, limits: Limits):
        self.per_image, self.left, self.total = limits.max_image_pixels, limits.max_request_pixels, limits.max_request_pixels
        self.command = limits.command

    def take(self, width: int, height: int, frames: int, where: str, count: int = 1) -> None:
        """Charge ``count`` images of ``width``×``height``×``frames`` pixels each: one check whatever
        ``count`` is (Python integers: a declared size of any magnitude is compared, never overflows)."""
        pixels = width * height * frames
        if pixels > self.per_image:
            raise BadRequest(f"{where}: {width}x{height}" + (f"x{frames} frames" if frames > 1 else "")
                             + f" = {pixels} pixels, over the server's limit of {self.per_image} per image "
                             f"({self.command} --max-image-pixels); send a smaller image", param=where,
                             status=413, code="request_too_large")
        if pixels * count > self.left:
            raise BadRequest(f"{where}: the request's images hold over {self.total} pixels in all (the server's "
                             f"limit per request, {self.command} --max-request-pixels); send fewer or smaller images",
                             param=where, status=413, code="request_too_large")
        self.left -= pixels * count


class DecodeBudget:
    """The bytes that the decoded samples of all requests in progress may hold together
    (``limits.max_decoded_bytes``), shared by every request thread of one server.

    A request :meth:`open` s a :class:`Reservation` and grows it before each allocation it makes; a
    reservation larger than the whole budget is refused at once (413), one that does not fit beside the
    others waits up to ``limits.decode_wait_s`` seconds for them to finish (then 503: busy, retry).
    """

    def __init__(self, limits: Limits):
        self.limit, self.wait_s, self.command = limits.max_decoded_bytes, limits.decode_wait_s, limits.command
        self.used = 0
        self._cond = threading.Condition()

    def open(self) -> "Reservation":
        return Reservation(self)

    def _take(self, nbytes: int, held: int, where: str) -> None:
        if held + nbytes > self.limit:
            raise BadRequest(f"{where}: decoding this request takes {(held + nbytes) / 2**20:.0f} MiB, over the "
                             f"server's {self.limit / 2**20:.0f} MiB for decoded samples ({self.command} "
                             "--max-decoded-mb); send fewer or smaller samples", param=where, status=413,
                             code="request_too_large")
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while self.used + nbytes > self.limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BadRequest(f"the server is decoding other requests ({self.used / 2**20:.0f} of "
                                     f"{self.limit / 2**20:.0f} MiB in use, {self.command} --max-decoded-mb); "
                                     "retry shortly", status=503, code="server_busy")
                self._cond.wait(left)
            self.used += nbytes

    def _give(self, nbytes: int) -> None:
        with self._cond:
            self.used -= nbytes
            self._cond.notify_all()


class Reservation:
    """One request's share of a :class:`DecodeBudget` (or of none: unbounded); released once, by
    :meth:`release`, whichever thread finishes with the samples (idempotent)."""

    def __init__(self, budget: DecodeBudget | None = None):
        self.budget, self.held = budget, 0
        self._lock = threading.Lock()

    def grow(self, nbytes: int, where: str) -> None:
        """Hold ``nbytes`` more before allocating them (:class:`BadRequest` 413 or 503 if they cannot be)."""
        if self.budget is not None and nbytes > 0:
            self.budget._take(nbytes, self.held, where)
            with self._lock:
                self.held += nbytes

    def release(self) -> None:
        with self._lock:
            held, self.held = self.held, 0
        if self.budget is not None and held:
            self.budget._give(held)


def peek_image(raw: bytes, budget: PixelBudget, where: str) -> Any:
    """Encoded image bytes → an undecoded PIL image (its header read), charged to ``budget``; decode it
    with :func:`decode_rgb`."""
    from PIL import Image, UnidentifiedImageError

    try:
        # open() reads the header only; PIL's own bomb check (DecompressionBombError) guards this step
        image = Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as e:
        raise BadRequest(f"{where}: too many pixels ({e}); send a smaller image", param=where, status=413,
                         code="request_too_large") from e
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise BadRequest(f"{where} does not hold a readable {'/'.join(IMAGE_FORMATS)} image ({e})", param=where) from e
    budget.take(image.width, image.height, 1, where)
    return image


def decode_rgb(image: Any, where: str) -> Any:
    """A :func:`peek_image` image decoded to RGB (the first frame of an animated one only)."""
    try:
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:  # a header that promises more than the data holds
        raise BadRequest(f"{where} does not hold a readable {'/'.join(IMAGE_FORMATS)} image ({e})", param=where) from e


#: bytes a decoded PIL RGB image takes per pixel (PIL stores RGB as 4 bytes), for reservations
PIL_RGB_BYTES = 4


def open_image(raw: bytes, budget: PixelBudget, where: str) -> Any:
    """Encoded image bytes → PIL RGB image, decoded only once its header's size fits ``budget``."""
    return decode_rgb(peek_image(raw, budget, where), where)


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
    add_number(parser, "--max-body-mb", type=float, lo=0, hi=MAX_SERVER_BODY_MB, lo_open=True, default=d.max_body_bytes / 2**20,
                        help="largest request body in MiB; a larger one gets 413 before it is read")
    add_number(parser, "--max-image-pixels", type=int, lo=1, hi=MAX_SERVER_IMAGE_PIXELS, default=d.max_image_pixels,
                        help="largest image (width x height) a request may send; checked before decoding")
    add_number(parser, "--max-request-pixels", type=int, lo=1, hi=MAX_SERVER_REQUEST_PIXELS, default=d.max_request_pixels,
                        help="most pixels of all the images of one request together")
    add_number(parser, "--header-timeout", type=float, lo=0, hi=MAX_TIMEOUT_S, lo_open=True, default=d.header_timeout_s,
                        help="seconds a client has to send its request headers (then 408, disconnected)")
    add_number(parser, "--body-timeout", type=float, lo=0, hi=MAX_TIMEOUT_S, lo_open=True, default=d.body_timeout_s,
                        help="seconds a client has to send its request body (then 408)")
    add_number(parser, "--max-decoded-mb", type=float, lo=0, hi=MAX_SERVER_DECODED_MB, lo_open=True, default=d.max_decoded_bytes / 2**20,
                        help="MiB the decoded samples of all requests in progress may hold together; a request "
                             "that needs more is refused (413), one that must wait longer than "
                             f"{d.decode_wait_s:g} s for its share gets 503")
    add_number(parser, "--max-connections", type=int, lo=1, hi=MAX_CONNECTIONS, default=d.max_connections,
                        help="requests served at once (more are answered 503; /health always answers), and "
                             "idle connections kept open (the oldest idle one is closed for a newcomer)")


def limits_from(args: Any, command: str) -> Limits:
    """:class:`Limits` from :func:`add_safety_flags`' flags (each checked, ``UserError`` naming the flag);
    refuses a ``--host`` beyond loopback without a key (:func:`check_bind`)."""
    for flag, value in (("--max-body-mb", args.max_body_mb), ("--max-image-pixels", args.max_image_pixels),
                        ("--max-request-pixels", args.max_request_pixels), ("--header-timeout", args.header_timeout),
                        ("--body-timeout", args.body_timeout), ("--max-decoded-mb", args.max_decoded_mb),
                        ("--max-connections", args.max_connections)):
        if not math.isfinite(value) or value <= 0:
            raise UserError(f"{command} {flag} {value}: give a number > 0")
    key = resolve_api_key(args.api_key)
    check_bind(args.host, key, args.insecure_no_auth, command)
    return Limits(api_key=key, max_body_bytes=int(args.max_body_mb * 2**20), header_timeout_s=args.header_timeout,
                  body_timeout_s=args.body_timeout, max_image_pixels=args.max_image_pixels,
                  max_request_pixels=args.max_request_pixels, max_decoded_bytes=int(args.max_decoded_mb * 2**20),
                  max_connections=args.max_connections, command=command)


def check_bind(host: str, api_key: str | None, insecure_no_auth: bool, command: str) -> None:
    """Refuse (``UserError``) to listen beyond loopback without a key, unless explicitly told to."""
    if api_key is None and not insecure_no_auth and not is_loopback(host):
        raise UserError(f"{command} --host {host} would serve anyone who can reach this machine without a key: "
                        f"set ${API_KEY_ENV} (or --api-key), or pass --insecure-no-auth on a trusted network")
