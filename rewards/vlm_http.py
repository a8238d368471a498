"""An OpenAI-compatible chat-completions client for VLM judges served by vLLM, SGLang or ``serve-judge``.

Images travel as base64 PNG data URLs. A forced reply prefix is sent the way vLLM (and
``flowalign serve-judge``) take it: a final assistant message with ``continue_final_message: true``
and ``add_generation_prompt: false``. Requests run concurrently (``concurrency`` threads); each
attempt has a hard deadline (``timeout`` seconds for connect + the whole reply), failed attempts are
retried with exponential backoff (``backoff · 2^attempt`` seconds, or the server's ``Retry-After``
up to ``timeout``) on connection errors, timeouts, 429 and 5xx, and a request that still fails comes back as a :class:`Completion` with ``error`` set,
so a dead server costs at most ``(retries+1)·timeout + backoff·(2^retries − 1)`` seconds per request
and never hangs a run.
"""

from __future__ import annotations

import base64
import io
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from flowalign.errors import UserError
from rewards.http_safety import API_KEY_ENV, read_reply
from rewards.vlm_backend import ChatRequest, Completion

_RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


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
        for name, value, lo in (("timeout", timeout, 0.0), ("backoff", backoff, 0.0)):
            if not isinstance(value, (int, float)) or value < lo or (name == "timeout" and value == 0):
                raise UserError(f"vlm_judge_http: {name}={value!r} must be a number > 0 (seconds)")
        for name, value, lo in (("retries", retries, 0), ("concurrency", concurrency, 1)):
            if not isinstance(value, int) or value < lo:
                raise UserError(f"vlm_judge_http: {name}={value!r} must be an integer >= {lo}")
        url = url.rstrip("/")
        self.base = url if url.endswith("/v1") else url + "/v1"
        self.model, self.timeout, self.retries, self.backoff = model, float(timeout), retries, float(backoff)
        self.concurrency = concurrency
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or os.environ.get("OPENAI_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.session = requests.Session()
        # one pooled connection per thread in flight (urllib3's pool is thread-safe)
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=concurrency)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.stats = {"requests": 0, "attempts": 0, "retries": 0, "failed": 0}
        self._lock, self._model_lock = threading.Lock(), threading.Lock()
        self._unreachable: str | None = None  # set when a request of the current batch ran out of retries

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    # --- transport ---------------------------------------------------------------------------------

    def _attempt(self, method: str, path: str, body: dict | None) -> dict:
        """One HTTP exchange with a hard deadline on the whole reply (a trickling server cannot stall it)."""
        try:
            status, headers, data = read_reply(self.session, method, self.base + path, body, self.headers,
                                               self.timeout)
        except TimeoutError as e:
            raise _Retryable(str(e)) from e
        except (requests.ConnectionError, requests.Timeout) as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from e
        if status in _RETRY_STATUS:
            try:
                wait = float(headers.get("Retry-After", ""))
            except ValueError:
                wait = None
            raise _Retryable(f"HTTP {status}: {data[:200].decode('utf-8', 'replace')}", wait)
        if status == 401:  # not worth a retry: the same key fails again
            raise RuntimeError(f"HTTP 401: the server wants a key; set ${API_KEY_ENV} (or the reward's api_key) to the "
                               f"key it was started with ({data[:200].decode('utf-8', 'replace')})")
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:300].decode('utf-8', 'replace')}")
        try:
            return json.loads(data)
        except json.JSONDecodeError as e:
            raise RuntimeError(f"reply is not JSON ({e}): {data[:200]!r}") from e

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
                    self.model = str(data["data"][0]["id"])
                except (KeyError, IndexError, TypeError) as e:
                    raise RuntimeError(f"{self.base}/models lists no model: {json.dumps(data)[:200]}") from e
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
            return parse_chat_reply(self._call("POST", "/chat/completions", body))
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


def parse_chat_reply(data: dict) -> Completion:
    """A chat-completions JSON reply → :class:`Completion` (logprobs read when the server sent them)."""
    try:
        choice = data["choices"][0]
        text = choice["message"]["content"]
    except (KeyError, IndexError, TypeError) as e:
        raise RuntimeError(f"not a chat-completions reply: {json.dumps(data)[:200]}") from e
    tokens: list[str] = []
    tops: list[list[tuple[str, float]]] = []
    for pos in ((choice.get("logprobs") or {}).get("content") or []):
        tokens.append(pos.get("token", ""))
        top = [(t["token"], float(t["logprob"])) for t in pos.get("top_logprobs") or []]
        if not any(t == tokens[-1] for t, _ in top):  # asked without top_logprobs: the chosen token alone
            top.append((tokens[-1], float(pos.get("logprob", float("-inf")))))
        tops.append(top)
    usage = data.get("usage") or {}
    return Completion(text=text if isinstance(text, str) else "", tokens=tokens, top_logprobs=tops,
                      finish_reason=choice.get("finish_reason") or "stop",
                      prompt_tokens=int(usage.get("prompt_tokens", 0) or 0))
