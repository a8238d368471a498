"""A small OpenAI-compatible server for any local transformers VLM (``flowalign serve-judge``).

FastAPI + uvicorn (the optional extra ``serve``). Endpoints:

* ``GET /v1/models``: the one served model (its folder name).
* ``POST /v1/chat/completions``: ``messages`` with text and ``image_url`` parts (base64 ``data:`` URLs
  only: the server fetches nothing), ``max_tokens`` (or ``max_completion_tokens``), ``temperature``
  (0 = greedy), ``seed``, ``logprobs`` / ``top_logprobs`` (at most ``max_top_logprobs``), and vLLM's
  ``continue_final_message`` / ``add_generation_prompt`` to force the start of the reply and
  ``chat_template_kwargs`` (``enable_thinking`` only, for a thinking model's template). ``n`` > 1
  and streaming are refused with 400.
* ``GET /health``: ``{"status": "ok"}``, the one path that needs no key.

Concurrent requests are batched: each is parsed and its images decoded in a thread of the server's
pool, then handed to a :class:`MicroBatcher`, whose worker waits up to ``max_wait`` seconds for up to
``batch_size`` requests and runs them as one batch (left padding) on the model; a request waiting for
its batch holds no thread. Images are decoded only after every other field is checked, and only once
their bytes fit the server's :class:`rewards.http_safety.DecodeBudget` (shared by all requests; held
until the request's completion is ready). The text of a request is capped at ``max_prompt_tokens``
tokens (413; a prompt's cost grows with the square of its length). The server is guarded by
:mod:`rewards.http_safety` (bearer key, body and pixel caps, header and body deadlines); every error
comes back in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 bad input,
401 key, 404 unknown model or path, 408 too slow, 413 too large, 503 busy, 500 only for a failure of
the server.
"""

# no "from __future__ import annotations": FastAPI reads the handler's Request annotation at runtime
import asyncio
import base64
import binascii
import json
import queue
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any

from rewards.http_safety import (PIL_RGB_BYTES, BadRequest, DecodeBudget, Limits, PixelBudget, Reservation,
                                 answer_errors_as_json, bind, decode_body, decode_rgb, error_response, peek_image,
                                 url_host, uvicorn_config)
from rewards.vlm_backend import ChatRequest, Completion, LocalVLM

#: seeds a request may give (torch generators take 64-bit seeds; JSON integers can be any size)
MAX_SEED = 2**63 - 1
#: text tokens a request may hold by default (``serve-judge --max-prompt-tokens``)
MAX_PROMPT_TOKENS = 8192
#: characters per token assumed by the cheap check made before tokenizing (no tokenizer's token is longer
#: in practice; a text past this many characters is refused without being tokenized)
CHARS_PER_TOKEN = 16


def decode_image_url(url: str, budget: PixelBudget, where: str = "image_url.url") -> Any:
    """A ``data:image/...;base64,...`` URL → PIL RGB image, decoded only if its size fits ``budget``."""
    return decode_rgb(peek_image_url(url, budget, where), where)


def peek_image_url(url: str, budget: PixelBudget, where: str = "image_url.url") -> Any:
    """A ``data:image/...;base64,...`` URL → undecoded PIL image (its header read), charged to ``budget``."""
    if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url:
        raise BadRequest(f"{where} must be a base64 data URL (data:image/png;base64,...);"
                         " this server fetches no remote images", param=where)
    try:
        raw = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadRequest(f"{where} is not valid base64 ({e})", param=where) from e
    return peek_image(raw, budget, where)


def _content(content: Any, where: str, budget: PixelBudget) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of parts", param=f"{where}.content")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            at = f"{where}.content[{j}].image_url.url"
            parts.append({"type": "image", "image": peek_image_url(url, budget, at), "where": at})
        else:
            raise BadRequest(f"{where}.content[{j}]: unsupported part type {kind!r} (use 'text' or 'image_url')",
                             param=f"{where}.content[{j}].type")
    return parts


def _integer(body: dict[str, Any], key: str, default: Any, lo: int, hi: int) -> Any:
    """``body[key]`` if it is an integer in ``lo..hi`` (a JSON ``true`` is no integer), else :class:`BadRequest`."""
    value = body.get(key, default)
    if value is default and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRequest(f"{key}={value!r} must be an integer in {lo}..{hi}", param=key)
    return value


def to_chat_request(body: dict[str, Any], max_top_logprobs: int, limits: Limits = Limits(),
                    reservation: Reservation | None = None, max_prompt_tokens: int | None = None,
                    count_tokens: Any = None) -> ChatRequest:
    """A chat-completions JSON body → :class:`ChatRequest` (raises :class:`BadRequest`); its images may hold
    at most ``limits.max_image_pixels`` each and ``limits.max_request_pixels`` together, and its text at
    most ``max_prompt_tokens`` tokens (None: no cap; ``count_tokens(text)`` counts them, else only the
    characters are checked). Images are decoded last, each held in ``reservation`` first."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a chat-completions JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    _integer(body, "n", 1, 1, 1)
    if body.get("stream"):
        raise BadRequest("stream=true is not supported", param="stream")
    budget = PixelBudget(limits)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise BadRequest(f"messages[{i}].role must be 'system', 'user' or 'assistant'", param=f"messages[{i}].role")
        out.append({"role": m["role"], "content": _content(m.get("content", ""), f"messages[{i}]", budget)})
    prefix = ""
    if body.get("continue_final_message"):
        if out[-1]["role"] != "assistant" or not isinstance(out[-1]["content"], str):
            raise BadRequest("continue_final_message needs a final assistant message with text content",
                             param="continue_final_message")
        if body.get("add_generation_prompt", True) is not False:
            raise BadRequest("continue_final_message requires add_generation_prompt=false", param="add_generation_prompt")
        prefix = out.pop()["content"]
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _integer(body, key, 16, 1, 8192)
    temperature = body.get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
        raise BadRequest(f"temperature={temperature!r} must be a number in [0, 2]", param="temperature")
    top = 0
    if body.get("logprobs"):
        top = _integer(body, "top_logprobs", 0, 0, max_top_logprobs) if body.get("top_logprobs") is not None else 0
        top = max(top, 1)  # the chosen token's own log-prob is always reported
    seed = _integer(body, "seed", None, 0, MAX_SEED)
    template_kwargs = body.get("chat_template_kwargs") or {}
    # only the switch a thinking model's template reads: other variables could rewrite the server's template
    if not isinstance(template_kwargs, dict) or set(template_kwargs) - {"enable_thinking"} \
            or not all(isinstance(v, bool) for v in template_kwargs.values()):
        raise BadRequest(f"chat_template_kwargs={template_kwargs!r} may only hold enable_thinking (true/false)",
                         param="chat_template_kwargs")
    if max_prompt_tokens is not None:
        _check_prompt_length(out, prefix, max_prompt_tokens, count_tokens, limits.command)
    _decode_images(out, reservation or Reservation())
    return ChatRequest(out, assistant_prefix=prefix, max_tokens=max_tokens, temperature=float(temperature),
                       top_logprobs=top, seed=seed, template_kwargs=dict(template_kwargs))


def _check_prompt_length(messages: list[dict[str, Any]], prefix: str, max_tokens: int, count_tokens: Any,
                         command: str) -> None:
    """413 for text over ``max_tokens`` tokens: first by its length in characters (no tokenizer run on a
    huge text), then by its tokens."""
    texts = [prefix] + [m["content"] if isinstance(m["content"], str) else p["text"]
                        for m in messages for p in ([m] if isinstance(m["content"], str) else m["content"])
                        if isinstance(m["content"], str) or p["type"] == "text"]
    chars = sum(len(t) for t in texts)
    refuse = (f"over the server's limit of {max_tokens} prompt tokens ({command} --max-prompt-tokens); "
              "send a shorter prompt")
    if chars > max_tokens * CHARS_PER_TOKEN:
        raise BadRequest(f"the messages hold {chars} characters of text, {refuse}", param="messages", status=413,
                         code="context_length_exceeded")
    if count_tokens is not None:
        tokens = count_tokens("\n".join(texts))
        if tokens > max_tokens:
            raise BadRequest(f"the messages hold {tokens} tokens of text, {refuse}", param="messages", status=413,
                             code="context_length_exceeded")


def _decode_images(messages: list[dict[str, Any]], reservation: Reservation) -> None:
    """Decode the images :func:`_content` peeked at, in place, each held in ``reservation`` first."""
    for m in messages:
        if isinstance(m["content"], list):
            for part in m["content"]:
                if part["type"] == "image":
                    image, where = part["image"], part.pop("where")
                    reservation.grow(image.width * image.height * PIL_RGB_BYTES, where)
                    part["image"] = decode_rgb(image, where)


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
        return self.submit_future(request).result()

    def submit_future(self, request: ChatRequest) -> Future:
        """Queue ``request``; the future holds its completion (or the error of its batch)."""
        future: Future = Future()
        self.queue.put((request, future))
        return future

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
            except BaseException as e:  # noqa: BLE001 - the whole batch failed: every waiting request gets
                for _, future in items:  # the error, and the worker lives on (a SystemExit must not end it)
                    if not future.done():
                        future.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))


def create_app(vlm: LocalVLM, *, model_name: str | None = None, max_top_logprobs: int = 20,
               max_wait: float = 0.005, limits: Limits = Limits(), max_prompt_tokens: int = MAX_PROMPT_TOKENS):
    """The FastAPI app serving ``vlm`` (``app.state.batcher`` holds its :class:`MicroBatcher`,
    ``app.state.limits`` the bounds :class:`BackgroundServer` and :func:`serve` enforce)."""
    from fastapi import FastAPI, Request

    name = model_name or vlm.name
    app = FastAPI(title="flowalign judge", version="1", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.batcher = batcher = MicroBatcher(vlm, max_wait=max_wait)
    app.state.limits = limits
    decoded = DecodeBudget(limits)
    tokenizer = getattr(vlm, "tokenizer", None)

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    def prepare(raw: bytes, reservation: Reservation) -> tuple[dict[str, Any], ChatRequest]:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise BadRequest(f"the body must be a chat-completions JSON object ({str(e)[:200]})") from e
        if not isinstance(body, dict):
            raise BadRequest("the body must be a chat-completions JSON object")
        if body.get("model") not in (None, name):
            raise BadRequest(f"model {str(body.get('model'))[:100]!r} is not served here; use {name!r}", "model",
                             status=404, code="model_not_found")
        return body, to_chat_request(body, max_top_logprobs, limits, reservation, max_prompt_tokens,
                                     count_tokens if tokenizer is not None else None)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "flowalign"}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        (body, chat_request), reservation = await decode_body(request, decoded, prepare)
        future = batcher.submit_future(chat_request)
        del chat_request
        future.add_done_callback(lambda _: reservation.release())  # the images are held until then
        try:
            completion = await asyncio.wrap_future(future)
        except Exception as e:  # a failed forward is the server's fault, reported, not a dead server
            return error_response(500, f"{type(e).__name__}: {e}"[:2000])
        return to_chat_reply(completion, name, bool(body.get("logprobs")))

    answer_errors_as_json(app)
    return app


class BackgroundServer:
    """Run an ASGI ``app`` with uvicorn in a daemon thread (tests, notebooks, in-process judges), guarded
    by ``limits`` (default: the app's ``state.limits``, as :func:`create_app` sets them).

    ``port=0`` picks a free port; ``url`` is then ``http://host:port/v1``. ``stop()`` shuts it down.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, limits: Limits | None = None):
        import uvicorn

        self.app = app
        limits = limits or getattr(getattr(app, "state", None), "limits", None) or Limits()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}/v1"
        self.server = uvicorn.Server(uvicorn_config(app, limits, log_level="warning", lifespan="off"))
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
          batch_size: int = 8, model_name: str | None = None, max_top_logprobs: int = 20,
          limits: Limits = Limits(), max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> None:
    """Load ``model`` and serve it until interrupted (the ``serve-judge`` command); prints the address it
    listens on (with ``port=0``, the port it was given)."""
    import uvicorn

    vlm = LocalVLM(model, device=device, dtype=dtype, batch_size=batch_size)
    app = create_app(vlm, model_name=model_name, max_top_logprobs=max_top_logprobs, limits=limits,
                     max_prompt_tokens=max_prompt_tokens)
    config = uvicorn_config(app, limits, host=host, port=port, log_level="info")
    sock, port = bind(config)
    auth = "a key required" if limits.api_key else "no key"
    print(f"serving {model_name or vlm.name} on http://{url_host(host)}:{port}/v1 (OpenAI chat completions, {auth})",
          flush=True)
    uvicorn.Server(config).run(sockets=[sock])
