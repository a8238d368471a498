"""An HTTP server for any registered reward (``flowalign serve-reward``), for the ``remote`` reward to call.

FastAPI + uvicorn (the optional extra ``serve``), guarded like ``serve-judge`` by
:mod:`rewards.http_safety` (bearer key, body and pixel caps, the shared budget of decoded bytes, header
and body deadlines). Endpoints:

* ``POST /v1/score``: a batch in the format of :mod:`rewards.reward_wire` → per-sample components,
  ``valid`` and reasons. A reward's own failure (anything it raises, ``SystemExit`` too) is 500 with its
  message, a call past its deadline 504; the client masks the batch either way.
* ``GET /v1/reward``: ``{"name", "spec", "timeout_s", "abandoned_calls"}``, the reward served.
* ``GET /health``: ``{"status": "ok"}``, the one path that needs no key.

Calls to the reward run one at a time (one batch at a time on its device; clients batch for
themselves), each in its own thread under a deadline: the SPEC's ``timeout_s``, else
:data:`DEFAULT_TIMEOUT_S`, counted from the request's arrival. A thread cannot be killed: a call past its
deadline is abandoned (504) and runs on in the background, holding its samples' memory, while the next
call starts. Once :data:`MAX_ABANDONED` abandoned calls are still running, new scoring requests get 503
at once (the GET endpoints keep answering), until one of them returns. A client that disconnects before
its call starts cancels it; one that disconnects during the call leaves it to finish or meet its
deadline. No request holds a thread of the server's pool while it waits.
"""

# no "from __future__ import annotations": FastAPI reads the handler's Request annotation at runtime
import asyncio
import json
import math
import threading
from typing import Any

from flowalign.reward_check import check_reward_output
from rewards.http_safety import (BadRequest, DecodeBudget, Limits, PixelBudget, Reservation, answer_errors_as_json,
                                 bind, decode_body, error_body, error_response, url_host, uvicorn_config)
from rewards.reward_wire import decode_request

#: seconds a reward call may take when the SPEC gives no ``timeout_s``
DEFAULT_TIMEOUT_S = 300.0
#: abandoned calls still running beyond which new scoring requests are refused (503)
MAX_ABANDONED = 4


def score_reply(name: str, out: Any, n: int) -> dict[str, Any]:
    """A reward's :class:`RewardOutput` as the reply JSON (non-finite values as null, invalid with a reason)."""
    out = check_reward_output(name, out, n)
    components = {k: [float(v) if math.isfinite(float(v)) else None for v in t.detach().float().cpu().tolist()]
                  for k, t in out.components.items()}
    valid = [bool(v) for v in out.valid.cpu().tolist()]
    reasons = []
    for i in range(n):
        info = out.info[i] if i < len(out.info) and isinstance(out.info[i], dict) else {}
        reasons.append("" if valid[i] else str(info.get("reason") or "marked invalid by the reward"))
    return {"name": name, "components": components, "valid": valid, "reasons": reasons}


class RewardRunner:
    """Calls one reward, one call at a time, each in its own daemon thread under a deadline (see the
    module docstring). ``abandoned``: calls past their deadline that are still running."""

    def __init__(self, reward: Any, *, name: str, device: str, timeout_s: float, max_abandoned: int = MAX_ABANDONED):
        self.reward, self.name, self.device = reward, name, device
        self.timeout_s, self.max_abandoned = float(timeout_s), max_abandoned
        self.abandoned = 0
        self.abandoned_total = 0
        self._lock = threading.Lock()
        self._slot: asyncio.Lock | None = None  # made in the server's event loop, on first use
        self._tasks: set[asyncio.Task] = set()

    @property
    def saturated(self) -> bool:
        return self.abandoned >= self.max_abandoned

    def refusal(self) -> tuple[int, dict[str, Any]]:
        return 503, error_body(503, f"reward {self.name!r}: {self.abandoned} calls past their deadline "
                                    f"(timeout_s={self.timeout_s:g} s) are still running; retry later",
                               code="server_busy")

    def start(self, samples: Any, prompts: list[str], metadata: list[dict[str, Any]], reservation: Reservation,
              deadline: float) -> tuple[asyncio.Task, dict[str, bool]]:
        """The task answering ``(status, body)`` for one batch, and its state (``started``: the reward has
        the batch). ``reservation`` is released once the samples are no longer held."""
        state = {"started": False}
        task = asyncio.ensure_future(self._call(samples, prompts, metadata, reservation, deadline, state))
        self._tasks.add(task)  # a task the handler leaves behind (its client gone) is kept until it ends
        task.add_done_callback(self._tasks.discard)
        return task, state

    async def _call(self, samples: Any, prompts: list[str], metadata: list[dict[str, Any]],
                    reservation: Reservation, deadline: float, state: dict[str, bool]) -> tuple[int, dict[str, Any]]:
        loop = asyncio.get_running_loop()
        if self._slot is None:
            self._slot = asyncio.Lock()
        try:
            try:
                await asyncio.wait_for(self._slot.acquire(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return 503, error_body(503, f"reward {self.name!r} was busy with other requests until this one's "
                                            f"deadline (timeout_s={self.timeout_s:g} s); retry", code="server_busy")
            try:
                if self.saturated:
                    return self.refusal()
                return await self._run(loop, samples, prompts, metadata, reservation, deadline, state)
            finally:
                self._slot.release()
        finally:
            if not state["started"]:
                reservation.release()

    async def _run(self, loop: asyncio.AbstractEventLoop, samples: Any, prompts: list[str],
                   metadata: list[dict[str, Any]], reservation: Reservation, deadline: float,
                   state: dict[str, bool]) -> tuple[int, dict[str, Any]]:
        import torch

        future: asyncio.Future = loop.create_future()
        call = {"done": False, "abandoned": False}

        def work() -> None:
            try:
                with torch.no_grad():
                    reply = 200, score_reply(self.name, self.reward(samples.to(self.device), prompts, metadata),
                                             len(prompts))
            except BaseException as e:  # noqa: BLE001 - a plug-in's SystemExit too: the client masks the batch
                reply = 500, error_body(500, f"reward {self.name!r} raised {type(e).__name__}: {e}"[:2000])
            reservation.release()
            with self._lock:
                call["done"] = True
                if call["abandoned"]:
                    self.abandoned -= 1
            try:
                loop.call_soon_threadsafe(lambda: future.done() or future.set_result(reply))
            except RuntimeError:  # the server has stopped; nobody waits for this reply
                pass

        threading.Thread(target=work, name=f"reward-{self.name}", daemon=True).start()
        state["started"] = True
        try:
            return await asyncio.wait_for(asyncio.shield(future), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            with self._lock:
                if not call["done"]:
                    call["abandoned"] = True
                    self.abandoned += 1
                    self.abandoned_total += 1
            if call["abandoned"]:
                return 504, error_body(504, f"reward {self.name!r} did not return within timeout_s="
                                            f"{self.timeout_s:g} s; the call is abandoned (raise the SPEC's "
                                            "timeout_s if the reward is just slow)", code="reward_timeout")
            return await future  # it returned just as the deadline passed


async def _disconnected(request: Any) -> None:
    """Returns once the client of ``request`` (whose body has been read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)


def create_app(reward: Any, *, name: str, spec: Any = None, device: str = "cpu",
               limits: Limits = Limits(command="serve-reward"), timeout_s: float | None = None,
               max_abandoned: int = MAX_ABANDONED):
    """The FastAPI app serving ``reward`` (samples are moved to ``device`` before scoring; each call has
    ``timeout_s`` seconds, :data:`DEFAULT_TIMEOUT_S` if None)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="flowalign reward", version="1", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.limits = limits
    app.state.runner = runner = RewardRunner(reward, name=name, device=device, max_abandoned=max_abandoned,
                                             timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    decoded = DecodeBudget(limits)

    def decode(raw: bytes, reservation: Reservation) -> tuple[Any, list[str], list[dict[str, Any]]]:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise BadRequest(f"the body must be a JSON object ({str(e)[:200]})") from e
        return decode_request(body, PixelBudget(limits), reservation)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/reward")
    async def info() -> dict[str, Any]:
        return {"name": name, "spec": spec, "timeout_s": runner.timeout_s, "abandoned_calls": runner.abandoned}

    @app.post("/v1/score")
    async def score(request: Request) -> Any:
        # nothing runs in a pool thread while it waits: decoding runs in one, the reward in its own thread
        loop = asyncio.get_running_loop()
        deadline = loop.time() + runner.timeout_s
        if runner.saturated:
            status, body = runner.refusal()
            return JSONResponse(body, status_code=status)
        (samples, prompts, metadata), reservation = await decode_body(request, decoded, decode)
        call, state = runner.start(samples, prompts, metadata, reservation, deadline)
        del samples
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not call.done():  # the client left: a call not started yet is dropped, a running one left to end
            if not state["started"]:
                call.cancel()
            return error_response(499, "the client disconnected")
        status, body = call.result()
        return JSONResponse(body, status_code=status)

    answer_errors_as_json(app)
    return app


def serve(reward: Any, *, name: str, spec: Any, host: str, port: int, device: str, limits: Limits,
          timeout_s: float | None = None) -> None:
    """Serve ``reward`` until interrupted (the ``serve-reward`` command); prints the address it listens
    on (with ``port=0``, the port it was given)."""
    import uvicorn

    app = create_app(reward, name=name, spec=spec, device=device, limits=limits, timeout_s=timeout_s)
    config = uvicorn_config(app, limits, host=host, port=port, log_level="info")
    sock, port = bind(config)
    auth = "a key required" if limits.api_key else "no key"
    url = f"http://{url_host(host)}:{port}"
    print(f"serving reward {name!r} on {url} ({auth}, timeout_s={app.state.runner.timeout_s:g}); use it as "
          f"{{name: remote, url: '{url}'}}", flush=True)
    uvicorn.Server(config).run(sockets=[sock])
