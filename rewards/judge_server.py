"""A small OpenAI-compatible server for any local transformers VLM (``flowalign serve-judge``).

FastAPI + uvicorn (the optional extra ``serve``). Endpoints:

* ``GET /v1/models``: the one served model (its folder name).
* ``POST /v1/chat/completions``: ``messages`` with text and ``image_url`` parts (base64 ``data:`` URLs
  only: the server fetches nothing), ``max_tokens`` (or ``max_completion_tokens``), ``temperature``
  (0 = greedy), ``seed``, ``logprobs`` / ``top_logprobs`` (at most ``max_top_logprobs``), and vLLM's
  ``continue_final_message`` / ``add_generation_prompt`` to force the start of the reply. ``n`` > 1
  and streaming are refused with 400.

Concurrent requests are batched: FastAPI answers each from its thread pool and hands it to a
:class:`MicroBatcher`, whose worker waits up to ``max_wait`` seconds for up to ``batch_size``
requests and runs them as one batch (left padding) on the model. Errors come back in OpenAI's shape
``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

import base64
import binascii
import io
import queue
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any

from rewards.vlm_backend import ChatRequest, Completion, LocalVLM


class BadRequest(Exception):
    """A request the server refuses (HTTP 400) with a message naming the field."""


def decode_image_url(url: str) -> Any:
    """A ``data:image/...;base64,...`` URL → PIL RGB image."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url:
        raise BadRequest("image_url.url must be a base64 data URL (data:image/png;base64,...);"
                         " this server fetches no remote images")
    try:
        raw = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
        return Image.open(io.BytesIO(raw)).convert("RGB")
    except (binascii.Error, UnidentifiedImageError, OSError) as e:
        raise BadRequest(f"image_url.url does not hold a readable image ({e})") from e


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            parts.append({"type": "image", "image": decode_image_url(url)})
        else:
            raise BadRequest(f"{where}.content[{j}]: unsupported part type {kind!r} (use 'text' or 'image_url')")
    return parts


def to_chat_request(body: dict[str, Any], max_top_logprobs: int) -> ChatRequest:
    """A chat-completions JSON body → :class:`ChatRequest` (raises :class:`BadRequest`)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise BadRequest(f"messages[{i}].role must be 'system', 'user' or 'assistant'")
        out.append({"role": m["role"], "content": _content(m.get("content", ""), f"messages[{i}]")})
    if body.get("n", 1) != 1:
        raise BadRequest("n must be 1")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported")
    prefix = ""
    if body.get("continue_final_message"):
        if out[-1]["role"] != "assistant" or not isinstance(out[-1]["content"], str):
            raise BadRequest("continue_final_message needs a final assistant message with text content")
        if body.get("add_generation_prompt", True) is not False:
            raise BadRequest("continue_final_message requires add_generation_prompt=false")
        prefix = out.pop()["content"]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16))
    if not isinstance(max_tokens, int) or not 1 <= max_tokens <= 8192:
        raise BadRequest(f"max_tokens={max_tokens!r} must be an integer in 1..8192")
    temperature = body.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
        raise BadRequest(f"temperature={temperature!r} must be a number in [0, 2]")
    top = 0
    if body.get("logprobs"):
        top = body.get("top_logprobs", 0) or 0
        if not isinstance(top, int) or not 0 <= top <= max_top_logprobs:
            raise BadRequest(f"top_logprobs={top!r} must be an integer in 0..{max_top_logprobs}")
        top = max(top, 1)  # the chosen token's own log-prob is always reported
    seed = body.get("seed")
    if seed is not None and not isinstance(seed, int):
        raise BadRequest(f"seed={seed!r} must be an integer")
    return ChatRequest(out, assistant_prefix=prefix, max_tokens=max_tokens, temperature=float(temperature),
                       top_logprobs=top, seed=seed)


def to_chat_reply(c: Completion, model: str, logprobs: bool) -> dict[str, Any]:
    """A :class:`Completion` → chat-completions JSON (``logprobs.content`` when asked)."""
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": c.text},
                              "finish_reason": c.finish_reason, "logprobs": None}
    if logprobs:
        content = []
        for pos, top in enumerate(c.top_logprobs):
            token = c.tokens[pos] if pos < len(c.tokens) else top[0][0]
            logprob = next((lp for t, lp in top if t == token), top[0][1])
            content.append({"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")),
                            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
                                             for t, lp in top]})
        choice["logprobs"] = {"content": content}
    n_out = len(c.tokens)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": c.prompt_tokens, "completion_tokens": n_out,
                      "total_tokens": c.prompt_tokens + n_out}}


class MicroBatcher:
    """Collects requests from many threads into batches for :meth:`LocalVLM.complete`.

    ``submit`` blocks until its completion is ready. The worker takes the first waiting request, then
    whatever else arrives within ``max_wait`` seconds, up to ``batch_size`` requests.
    """

    def __init__(self, vlm: LocalVLM, *, batch_size: int | None = None, max_wait: float = 0.005):
        self.vlm, self.max_wait = vlm, max_wait
        self.batch_size = batch_size or vlm.batch_size
        self.queue: queue.Queue[tuple[ChatRequest, Future]] = queue.Queue()
        self.batches: list[int] = []  # sizes of the batches run (for logs and tests)
        threading.Thread(target=self._work, daemon=True, name="judge-batcher").start()

    def submit(self, request: ChatRequest) -> Completion:
        future: Future = Future()
        self.queue.put((request, future))
        return future.result()

    def _work(self) -> None:
        while True:
            items = [self.queue.get()]
            deadline = time.monotonic() + self.max_wait
            while len(items) < self.batch_size:
                try:
                    items.append(self.queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            self.batches.append(len(items))
            try:
                results = self.vlm.complete([r for r, _ in items])
                for (_, future), result in zip(items, results):
                    future.set_result(result)
            except Exception as e:  # the whole batch failed: every waiting request gets the error
                for _, future in items:
                    future.set_exception(e)


def create_app(vlm: LocalVLM, *, model_name: str | None = None, max_top_logprobs: int = 20,
               max_wait: float = 0.005):
    """The FastAPI app serving ``vlm`` (``app.state.batcher`` holds its :class:`MicroBatcher`)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    name = model_name or vlm.name
    app = FastAPI(title="flowalign judge", version="1")
    app.state.batcher = batcher = MicroBatcher(vlm, max_wait=max_wait)

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "flowalign"}]}

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    def chat(body: dict[str, Any]) -> Any:  # sync: FastAPI runs it in its thread pool
        try:
            request = to_chat_request(body, max_top_logprobs)
        except BadRequest as e:
            return error(400, str(e))
        if body.get("model") not in (None, name):
            return error(404, f"model {body.get('model')!r} is not served here; use {name!r}", "not_found_error")
        try:
            completion = batcher.submit(request)
        except Exception as e:  # a failed forward is the server's fault, reported, not a dead server
            return error(500, f"{type(e).__name__}: {e}", "server_error")
        return to_chat_reply(completion, name, bool(body.get("logprobs")))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, e: RequestValidationError) -> JSONResponse:
        return error(400, f"the body must be a chat-completions JSON object ({str(e.errors())[:200]})")

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> JSONResponse:
        return error(500, f"{type(e).__name__}: {e}", "server_error")

    return app


class BackgroundServer:
    """Run an ASGI ``app`` with uvicorn in a daemon thread (tests, notebooks, in-process judges).

    ``port=0`` picks a free port; ``url`` is then ``http://host:port/v1``. ``stop()`` shuts it down.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"judge server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, device: str = "cpu", dtype: str = "fp32",
          batch_size: int = 8, model_name: str | None = None, max_top_logprobs: int = 20) -> None:
    """Load ``model`` and serve it until interrupted (the ``serve-judge`` command)."""
    import uvicorn

    vlm = LocalVLM(model, device=device, dtype=dtype, batch_size=batch_size)
    app = create_app(vlm, model_name=model_name, max_top_logprobs=max_top_logprobs)
    print(f"serving {model_name or vlm.name} on http://{host}:{port}/v1 (OpenAI chat completions)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="info")
