"""An OpenAI-compatible chat-completions client for VLM judges served by vLLM, SGLang or ``serve-judge``.

Images travel as base64 PNG data URLs. A forced reply prefix is sent the way vLLM (and
``flowalign serve-judge``) take it: a final assistant message with ``continue_final_message: true``
and ``add_generation_prompt: false``. Requests run concurrently (``concurrency`` threads); each
attempt has a hard deadline (``timeout`` seconds for connect + the whole reply, however slowly the
server trickles it) and a reply-size cap (:data:`MAX_REPLY_BYTES`, :mod:`rewards.http_client`).
Failed attempts are retried with exponential backoff (``backoff · 2^attempt`` seconds, or the
server's ``Retry-After`` up to ``timeout``) on connection errors, timeouts, 429 and 5xx, and a
request that still fails comes back as a :class:`Completion` with ``error`` set, so a dead server
costs at most ``(retries+1)·timeout + backoff·(2^retries − 1)`` seconds per request and never hangs
a run. A reply is read strictly (:func:`parse_chat_reply`): text as text, log-probabilities as
numbers, no more positions and alternatives than were asked for; anything else is that request's
``error``, never an exception.
"""

from __future__ import annotations

import base64
import io
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flowalign.errors import UserError
from rewards.http_client import ReplyError, one_line
from rewards.http_client import request as http_request
from rewards.http_safety import API_KEY_ENV
from rewards.vlm_backend import ChatRequest, Completion

_RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
#: the largest reply read (a chat completion with thousands of log-prob alternatives is a few MB)
MAX_REPLY_BYTES = 64 * 2**20
#: slack over what a request asked for: a stop token past ``max_tokens``, the chosen token beside its
#: ``top_logprobs`` alternatives, a server that rounds up
_SLACK = 8


class _Retryable(Exception):
    """A failure worth another attempt; ``wait``: the server's Retry-After, in seconds, if it sent one."""

    def __init__(self, message: str, wait: float | None = None):
        super().__init__(message)
        self.wait = wait


def image_data_url(image: Any) -> str:
    """A PIL image as a lossless ``data:image/png;base64,...`` URL."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def to_openai_messages(request: ChatRequest) -> list[dict[str, Any]]:
    """The request's messages in the chat-completions wire format (+ the forced assistant prefix)."""
    out = []
    for m in request.messages:
        if isinstance(m["content"], list):
            parts = [{"type": "image_url", "image_url": {"url": image_data_url(p["image"])}}
                     if p.get("type") == "image" else {"type": "text", "text": p["text"]} for p in m["content"]]
            out.append({"role": m["role"], "content": parts})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if request.assistant_prefix:
        out.append({"role": "assistant", "content": request.assistant_prefix})
    return out


class OpenAIChatClient:
    """``complete(requests)`` against ``{url}/chat/completions`` (``url`` with or without ``/v1``).

    ``model``: the served model's name; None asks ``/v1/models`` once and takes the first.
    ``api_key``: sent as a bearer token (default: ``$FLOWALIGN_API_KEY``, the key ``serve-judge`` reads,
    else ``$OPENAI_API_KEY``, when set).
    """

    def __init__(self, url: str, model: str | None = None, *, api_key: str | None = None, timeout: float = 60.0,
                 retries: int = 3, backoff: float = 1.0, concurrency: int = 8):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise UserError(f"vlm_judge_http: url={url!r} must start with http:// or https://"
                            " (e.g. http://127.0.0.1:8000/v1)")
        for name, value, lo, hi in (("timeout", timeout, 0.0, 86_400.0), ("backoff", backoff, 0.0, 3600.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi \
                    or (name == "timeout" and value == 0):
                raise UserError(f"vlm_judge_http: {name}={value!r} must be a number of seconds "
                                f"{'> 0' if name == 'timeout' else '>= 0'} and <= {hi:g}")
        for name, value, lo, hi in (("retries", retries, 0, 100), ("concurrency", concurrency, 1, 1024)):
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise UserError(f"vlm_judge_http: {name}={value!r} must be an integer from {lo} to {hi}")
        url = url.rstrip("/")
        self.base = url if url.endswith("/v1") else url + "/v1"
        self.model, self.timeout, self.retries, self.backoff = model, float(timeout), retries, float(backoff)
        self.concurrency = concurrency
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or os.environ.get("OPENAI_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.stats = {"requests": 0, "attempts": 0, "retries": 0, "failed": 0}
        self._lock, self._model_lock = threading.Lock(), threading.Lock()
        self._unreachable: str | None = None  # set when a request of the current batch ran out of retries

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    # --- transport ---------------------------------------------------------------------------------

    def _attempt(self, method: str, path: str, body: dict | None) -> Any:
        """One HTTP exchange within ``timeout`` and :data:`MAX_REPLY_BYTES` (:func:`rewards.http_client.request`)."""
        try:
            reply = http_request(method, self.base + path, body, self.headers, timeout=self.timeout,
                            max_bytes=MAX_REPLY_BYTES)
        except ReplyError as e:
            if e.retryable:
                raise _Retryable(str(e)) from None
            raise RuntimeError(str(e)) from None
        if reply.status in _RETRY_STATUS:
            try:
                wait = float(reply.headers.get("Retry-After", ""))
            except ValueError:
                wait = None
            if wait is not None and not 0 <= wait < math.inf:  # a negative or non-finite Retry-After is no advice
                wait = None
            raise _Retryable(f"HTTP {reply.status}: {reply.error_message()}", wait)
        if reply.status == 401:  # not worth a retry: the same key fails again
            raise RuntimeError(f"HTTP 401: the server wants a key; set ${API_KEY_ENV} (or the reward's api_key) to the "
                               f"key it was started with ({reply.error_message()})")
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {reply.error_message()}")
        try:
            return reply.json()
        except ReplyError as e:
            raise RuntimeError(str(e)) from None

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        """``_attempt`` with retries and exponential backoff; raises after the last failure.

        Once one request of a batch has exhausted its retries on transport errors, the others stop
        retrying (one failing request already proved the server unreachable; a batch of B requests
        must not wait B times the retry budget).
        """
        last = ""
        for attempt in range(self.retries + 1):
            if self._unreachable is not None:
                raise RuntimeError(f"server unreachable, not retried ({self._unreachable})")
            self._count("attempts")
            try:
                return self._attempt(method, path, body)
            except _Retryable as e:
                last = str(e)
                if attempt < self.retries:
                    self._count("retries")
                    delay = self.backoff * 2**attempt
                    if e.wait is not None:  # an overloaded server's Retry-After, capped by the request timeout
                        delay = max(delay, min(e.wait, self.timeout))
                    time.sleep(delay)
        self._unreachable = last[:200]
        raise RuntimeError(f"{self.base}{path} failed after {self.retries + 1} attempts: {last}")

    def model_name(self) -> str:
        with self._model_lock:  # one /models query, however many threads ask at once
            if self.model is None:
                data = self._call("GET", "/models")
                try:
                    name = data["data"][0]["id"]
                except (KeyError, IndexError, TypeError):
                    name = None
                if not isinstance(name, str) or not 0 < len(name) <= 1000:
                    raise RuntimeError(f"{self.base}/models lists no model (data[0].id is not a name); "
                                       "give the judge's model")
                self.model = name
            return self.model

    # --- chat completions --------------------------------------------------------------------------

    def _complete_one(self, request: ChatRequest) -> Completion:
        self._count("requests")
        try:
            body: dict[str, Any] = {
                "model": self.model_name(), "messages": to_openai_messages(request),
                "max_tokens": request.max_tokens, "temperature": request.temperature,
            }
            if request.seed is not None:
                body["seed"] = request.seed
            if request.top_logprobs > 0:
                body.update(logprobs=True, top_logprobs=request.top_logprobs)
            if request.assistant_prefix:
                body.update(continue_final_message=True, add_generation_prompt=False)
            if request.template_kwargs:
                body["chat_template_kwargs"] = request.template_kwargs
            return parse_chat_reply(self._call("POST", "/chat/completions", body), request)
        except Exception as e:  # every failure becomes an invalid sample upstream, never a crash
            self._count("failed")
            return Completion(text=None, error=f"{type(e).__name__}: {e}")

    def complete(self, requests_: list[ChatRequest]) -> list[Completion]:
        """Answer ``requests_`` concurrently; failures come back as completions with ``error`` set."""
        if not requests_:
            return []
        self._unreachable = None  # every batch tries the server afresh
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests_))) as pool:
            return list(pool.map(self._complete_one, requests_))


def _logprob(value: Any, where: str) -> float:
    """A log-probability as the server sent it: a JSON number, not NaN, at most 0 (a hair above for
    rounding); −inf (an impossible token) is one. Anything else is a broken reply."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RuntimeError(f"{where} is {type(value).__name__} {one_line(repr(value), 40)}, not a number")
    try:
        value = float(value)
    except OverflowError:  # an integer past the float range
        value = math.inf if value > 0 else -math.inf
    if math.isnan(value) or value > 1e-3:
        raise RuntimeError(f"{where} is {value!r}, not a log-probability (a number <= 0)")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RuntimeError(f"{where} is {type(value).__name__}, not text")
    return value


def parse_chat_reply(data: Any, request: ChatRequest | None = None) -> Completion:
    """A chat-completions JSON reply → :class:`Completion` (logprobs read when the server sent them).

    Read strictly, since a reply decides a reward: ``message.content`` is text (null reads as ""),
    tokens are text, log-probabilities are numbers <= 0 (:func:`_logprob`), and, given the ``request``,
    there are no more positions than its ``max_tokens``, no more alternatives per position than its
    ``top_logprobs`` and no more text than those tokens could spell (each with a little slack).
    Anything else raises ``RuntimeError`` with one line saying what, which the client turns into the
    completion's ``error``.
    """
    try:
        choice = data["choices"][0]
        message = choice["message"]
        text = message["content"]
    except (KeyError, IndexError, TypeError):
        raise RuntimeError("not a chat-completions reply (no choices[0].message.content)") from None
    if not isinstance(choice, dict) or not isinstance(message, dict):
        raise RuntimeError("not a chat-completions reply (choices[0] is not an object)")
    text = "" if text is None else _text(text, "message.content")
    max_positions = request.max_tokens + _SLACK if request is not None else None
    max_top = request.top_logprobs + _SLACK if request is not None else None
    if max_positions is not None and len(text) > 256 * max_positions + 4096:
        raise RuntimeError(f"message.content holds {len(text)} characters, more than {request.max_tokens} "
                           "tokens spell")
    logprobs = choice.get("logprobs") or {}
    positions = (logprobs.get("content") or []) if isinstance(logprobs, dict) else None
    if not isinstance(positions, list):
        raise RuntimeError("logprobs.content is not a list of positions")
    if max_positions is not None and len(positions) > max_positions:
        raise RuntimeError(f"logprobs.content holds {len(positions)} positions for max_tokens={request.max_tokens}")
    tokens: list[str] = []
    tops: list[list[tuple[str, float]]] = []
    for i, pos in enumerate(positions):
        if not isinstance(pos, dict):
            raise RuntimeError(f"logprobs.content[{i}] is not an object")
        tokens.append(_text(pos.get("token", ""), f"logprobs.content[{i}].token"))
        alternatives = pos.get("top_logprobs") or []
        if not isinstance(alternatives, list) or (max_top is not None and len(alternatives) > max_top):
            raise RuntimeError(f"logprobs.content[{i}].top_logprobs is not a list of at most "
                               f"{request.top_logprobs if request is not None else 'the asked'} alternatives")
        top = []
        for j, t in enumerate(alternatives):
            where = f"logprobs.content[{i}].top_logprobs[{j}]"
            if not isinstance(t, dict) or "token" not in t or "logprob" not in t:
                raise RuntimeError(f"{where} is not a {{token, logprob}} object")
            top.append((_text(t["token"], where + ".token"), _logprob(t["logprob"], where + ".logprob")))
        if not any(t == tokens[-1] for t, _ in top):  # asked without top_logprobs: the chosen token alone
            top.append((tokens[-1], _logprob(pos.get("logprob", -math.inf), f"logprobs.content[{i}].logprob")))
        tops.append(top)
    finish = choice.get("finish_reason") or "stop"
    usage = data.get("usage") or {}
    prompt_tokens = usage.get("prompt_tokens", 0) if isinstance(usage, dict) else 0
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 0:
        prompt_tokens = 0  # bookkeeping only: a server that miscounts does not void the judgement
    return Completion(text=text, tokens=tokens, top_logprobs=tops,
                      finish_reason=one_line(finish, 40) if isinstance(finish, str) else "stop",
                      prompt_tokens=prompt_tokens)
