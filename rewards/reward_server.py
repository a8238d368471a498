"""An HTTP server for any registered reward (``flowalign serve-reward``), for the ``remote`` reward to call.

FastAPI + uvicorn (the optional extra ``serve``), guarded like ``serve-judge`` by
:mod:`rewards.http_safety` (bearer key, body and pixel caps, header and body deadlines). Endpoints:

* ``POST /v1/score``: a batch in the format of :mod:`rewards.reward_wire` → per-sample components,
  ``valid`` and reasons. A reward's own failure is 500 with its message (the client masks the batch).
* ``GET /v1/reward``: ``{"name", "spec"}``, the reward served.
* ``GET /health``: ``{"status": "ok"}``, the one path that needs no key.

Calls to the reward are serialised (one batch at a time on its device); clients batch for themselves.
"""

from __future__ import annotations

import math
import threading
from typing import Any

from flowalign.reward_check import check_reward_output
from rewards.http_safety import BadRequest, Limits, PixelBudget, error_body, uvicorn_config
from rewards.reward_wire import decode_request


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


def create_app(reward: Any, *, name: str, spec: Any = None, device: str = "cpu", limits: Limits = Limits(command="serve-reward")):
    """The FastAPI app serving ``reward`` (samples are moved to ``device`` before scoring)."""
    import torch
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="flowalign reward", version="1", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.limits = limits
    lock = threading.Lock()

    def error(status: int, message: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(status, message, param), status_code=status)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/reward")
    def info() -> dict[str, Any]:
        return {"name": name, "spec": spec}

    @app.post("/v1/score")
    def score(body: dict[str, Any]) -> Any:  # sync: FastAPI runs it in its thread pool
        try:
            samples, prompts, metadata = decode_request(body, PixelBudget(limits))
        except BadRequest as e:
            return error(e.status, str(e), e.param)
        try:
            with lock, torch.no_grad():
                return score_reply(name, reward(samples.to(device), prompts, metadata), len(prompts))
        except Exception as e:  # noqa: BLE001 - the reward's failure, reported to the client that masks it
            return error(500, f"reward {name!r} raised {type(e).__name__}: {e}")

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, e: RequestValidationError) -> JSONResponse:
        return error(400, f"the body must be a JSON object ({str(e.errors())[:200]})")

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:  # unknown path, wrong method
        return error(e.status_code, str(e.detail))

    return app


def serve(reward: Any, *, name: str, spec: Any, host: str, port: int, device: str, limits: Limits) -> None:
    """Serve ``reward`` until interrupted (the ``serve-reward`` command)."""
    import uvicorn

    app = create_app(reward, name=name, spec=spec, device=device, limits=limits)
    auth = "a key required" if limits.api_key else "no key"
    print(f"serving reward {name!r} on http://{host}:{port} ({auth}); use it as "
          f"{{name: remote, url: 'http://{host}:{port}'}}", flush=True)
    uvicorn.Server(uvicorn_config(app, limits, host=host, port=port, log_level="info")).run()
