"""``remote``: a reward scored by ``flowalign serve-reward`` on another process or machine.

>>> reward = rewards.load("remote", url="http://gpu-box:8100", api_key="...", timeout=60)

Samples travel as float32 safetensors by default (``encoding``), so the scores equal the in-process
ones; ``uint8`` (4× smaller) and ``png`` / ``mp4`` send what a PNG or MP4 keeps (quantised to 8 bits;
MP4 also lossy). A batch larger than ``max_request_mb`` goes as several requests. Per-prompt metadata
travels as JSON (a dataclass as its fields, other values as text).

A dead, slow or failing server never stops a run and never scores 0: each request has ``timeout``
seconds for its whole reply, and the samples of a request that fails are invalid (NaN, ``valid``
False, the reason in ``info``), which masks them as any failed reward does. Scoring runs in the
loop's reward thread, so it overlaps the next rollout batch like a local reward.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any

import torch

from flowalign.errors import UserError
from flowalign.protocols import RewardOutput
from rewards.http_safety import API_KEY_ENV, read_reply
from rewards.registry import register
from rewards.reward_wire import ENCODINGS, bytes_per_sample, encode_samples


class RemoteError(Exception):
    """A request the server did not answer with scores (unreachable, too slow, an error status)."""


@register("remote")
class RemoteReward:
    """The reward served at ``url`` (``flowalign serve-reward``); see the module docstring."""

    differentiable = False

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 60.0, encoding: str = "float32",
                 max_request_mb: float = 16.0):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise UserError(f"remote reward: url={url!r} must be the server's http(s)://host:port "
                            "(what flowalign serve-reward prints)")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise UserError(f"remote reward: timeout={timeout!r} must be a number of seconds > 0")
        if encoding not in ENCODINGS:
            raise UserError(f"remote reward: encoding={encoding!r}; choose one of {', '.join(ENCODINGS)}")
        if isinstance(max_request_mb, bool) or not isinstance(max_request_mb, (int, float)) or not max_request_mb > 0:
            raise UserError(f"remote reward: max_request_mb={max_request_mb!r} must be a number > 0")
        import requests

        self.url, self.timeout, self.encoding = url.rstrip("/"), float(timeout), encoding
        self.max_request_bytes = int(max_request_mb * 2**20)
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.session = requests.Session()
        self.name = "remote"
        self._components: list[str] | None = None  # the served reward's component names, once seen

    def __call__(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        n = samples.shape[0]
        metadata = metadata or [{} for _ in range(n)]
        per_request = max(1, self.max_request_bytes // bytes_per_sample(samples, self.encoding))
        parts = []
        for start in range(0, n, per_request):
            stop = min(n, start + per_request)
            try:
                parts.append(self._score(samples[start:stop], prompts[start:stop], metadata[start:stop]))
            except RemoteError as e:
                print(f"warning: remote reward at {self.url}: {e}; its {stop - start} samples are invalid",
                      file=sys.stderr, flush=True)
                parts.append(self._invalid(stop - start, f"remote reward at {self.url}: {e}"))
        return _cat(parts, samples.device)

    def _score(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"prompts": list(prompts), "metadata": json.loads(json.dumps(metadata, default=_jsonable)),
                **encode_samples(samples, self.encoding)}
        reply = self._post("/v1/score", body)
        try:
            components, valid, reasons = reply["components"], reply["valid"], reply["reasons"]
            if not components or any(len(v) != len(prompts) for v in [*components.values(), valid, reasons]):
                raise ValueError("lengths differ from the request's")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RemoteError(f"the reply is not a score reply ({e}); is {self.url} a flowalign serve-reward?") from e
        self._components = list(components)
        return {"components": components, "valid": valid, "reasons": reasons}

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One request with a hard deadline on the whole reply (a trickling server cannot stall it)."""
        import requests

        try:
            status, _, data = read_reply(self.session, "POST", self.url + path, body, self.headers, self.timeout)
        except TimeoutError as e:
            raise RemoteError(str(e)) from e
        except (requests.ConnectionError, requests.Timeout) as e:
            raise RemoteError(f"no reply within timeout={self.timeout:g} s ({type(e).__name__})") from e
        if status != 200:
            try:
                message = json.loads(data)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = data[:200].decode("utf-8", "replace")
            hint = f" (set ${API_KEY_ENV} or the reward's api_key)" if status == 401 else ""
            raise RemoteError(f"HTTP {status}: {message}{hint}")
        try:
            return json.loads(data)
        except ValueError as e:
            raise RemoteError(f"the reply is not JSON ({e})") from e

    def _invalid(self, n: int, reason: str) -> dict[str, Any]:
        """A failed request's samples: NaN in every component (never 0), invalid, with the reason."""
        return {"components": {k: [None] * n for k in (self._components or ["remote"])},
                "valid": [False] * n, "reasons": [reason] * n}


def _cat(parts: list[dict[str, Any]], device: torch.device) -> RewardOutput:
    """The replies of consecutive requests as one output (a component a part lacks is NaN there)."""
    names = list(dict.fromkeys(k for p in parts for k in p["components"]))
    components = {}
    for name in names:
        values = [v for p in parts for v in p["components"].get(name, [None] * len(p["valid"]))]
        components[name] = torch.tensor([math.nan if v is None else float(v) for v in values],
                                        dtype=torch.float32, device=device)
    valid = torch.tensor([bool(v) for p in parts for v in p["valid"]], dtype=torch.bool, device=device)
    info = [{"reason": r} if r else {} for p in parts for r in p["reasons"]]
    return RewardOutput(components, valid, info)


def _jsonable(value: Any) -> Any:
    """Metadata values JSON has no form for: a dataclass as its fields, anything else as text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)
