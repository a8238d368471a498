"""``remote``: a reward scored by ``flowalign serve-reward`` on another process or machine.

>>> reward = rewards.load("remote", url="http://gpu-box:8100", api_key="...", timeout=60)

Samples travel as float32 safetensors by default (``encoding``), so the scores equal the in-process
ones; ``uint8`` (4× smaller) and ``png`` / ``mp4`` send what a PNG or MP4 keeps (quantised to 8 bits;
MP4 also lossy). A batch larger than ``max_request_mb`` goes as several requests. Per-prompt metadata
travels as JSON (a dataclass as its fields, other values as text, non-finite numbers as null).

A dead, slow, failing or misbehaving server never stops a run and never scores 0: each request has
``timeout`` seconds for its whole reply (a server that trickles its reply is cut off at the deadline),
a reply over ``max_reply_mb`` is not read past the cap, and every reply is checked before a value of
it is used (:func:`parse_score_reply`). The samples of a request that fails any of this are invalid
(NaN, ``valid`` False, the one-line reason in ``info``), which masks them as any failed reward does.
Scoring runs in the loop's reward thread, so it overlaps the next rollout batch like a local reward.
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
from flowalign.strict_json import finite_or_null
from rewards.http_client import ReplyError, loads, one_line, request
from rewards.http_safety import API_KEY_ENV
from rewards.planning import holds_nothing
from rewards.registry import register
from rewards.reward_wire import ENCODINGS, bytes_per_sample, encode_samples

#: components one reply may name (a served reward has a handful; thousands is a broken or hostile server)
MAX_COMPONENTS = 256
#: characters of a component name
MAX_NAME_CHARS = 200
#: the largest magnitude a score may have: beyond it the weighted sums of float32 rewards overflow, and no
#: real reward comes near it, so a larger value is a fault of the server's (the sample is invalid)
MAX_ABS_SCORE = 1e30
#: characters kept of a reason the server gives for an invalid sample
MAX_REASON_CHARS = 300
#: the largest ``timeout`` (a day) and ``max_request_mb`` / ``max_reply_mb`` (1 GiB) accepted
MAX_TIMEOUT_S = 86_400.0
MAX_MB = 1024.0


class RemoteError(Exception):
    """A request the server did not answer with scores (unreachable, too slow, an error status, a bad reply)."""


def _check_number(option: str, value: Any, limit: float, unit: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= limit:
        raise UserError(f"remote reward: {option}={value!r} must be a number of {unit} > 0 and <= {limit:g}")
    return float(value)


@register("remote")
class RemoteReward:
    """The reward served at ``url`` (``flowalign serve-reward``); see the module docstring."""

    differentiable = False
    #: the model runs behind the server: nothing on this process's device (flowalign plan)
    planned_bytes = staticmethod(holds_nothing)

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 60.0, encoding: str = "float32",
                 max_request_mb: float = 16.0, max_reply_mb: float = 16.0):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise UserError(f"remote reward: url={url!r} must be the server's http(s)://host:port "
                            "(what flowalign serve-reward prints)")
        self.timeout = _check_number("timeout", timeout, MAX_TIMEOUT_S, "seconds")
        if encoding not in ENCODINGS:
            raise UserError(f"remote reward: encoding={encoding!r}; choose one of {', '.join(ENCODINGS)}")
        self.max_request_bytes = int(_check_number("max_request_mb", max_request_mb, MAX_MB, "MiB") * 2**20)
        self.max_reply_bytes = int(_check_number("max_reply_mb", max_reply_mb, MAX_MB, "MiB") * 2**20)
        self.url, self.encoding = url.rstrip("/"), encoding
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
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
            except Exception as e:  # noqa: BLE001 - whatever a server does, its samples are invalid, never a crash
                reason = str(e) if isinstance(e, RemoteError) else one_line(f"{type(e).__name__}: {e}", 300)
                print(f"warning: remote reward at {self.url}: {reason}; its {stop - start} samples are invalid",
                      file=sys.stderr, flush=True)
                parts.append(self._invalid(stop - start, f"remote reward at {self.url}: {reason}"))
        return _cat(parts, samples.device)

    def _score(self, samples: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> dict[str, Any]:
        # metadata as JSON has it: a dataclass as its fields, a NaN as null (strict JSON has no NaN)
        metadata = finite_or_null(json.loads(json.dumps(metadata, default=_jsonable)))
        body = {"prompts": list(prompts), "metadata": metadata, **encode_samples(samples, self.encoding)}
        try:
            reply = request("POST", self.url + "/v1/score", body, self.headers, timeout=self.timeout,
                            max_bytes=self.max_reply_bytes)
            if reply.status != 200:
                hint = f" (set ${API_KEY_ENV} or the reward's api_key)" if reply.status == 401 else ""
                raise RemoteError(f"HTTP {reply.status}: {reply.error_message()}{hint}")
            parsed = parse_score_reply(reply.body, len(prompts))
        except ReplyError as e:
            raise RemoteError(str(e)) from None
        except ValueError as e:
            raise RemoteError(f"{e}; is {self.url} a flowalign serve-reward?") from None
        self._components = list(parsed["components"])
        return parsed

    def _invalid(self, n: int, reason: str) -> dict[str, Any]:
        """A failed request's samples: NaN in every component (never 0), invalid, with the reason."""
        return {"components": {k: [math.nan] * n for k in (self._components or ["remote"])},
                "valid": [False] * n, "reasons": [reason] * n}


def _score_value(value: Any, where: str) -> float:
    """One score of a reply as a float: NaN for null or a non-finite number (the sample will be invalid);
    ``ValueError`` for anything that is not a JSON number (a string, a boolean, an object)."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} is {type(value).__name__} {one_line(repr(value), 40)}, not a number")
    try:
        return float(value)
    except OverflowError:  # an integer past the float range
        return math.inf


def parse_score_reply(data: bytes, n: int) -> dict[str, Any]:
    """A ``/v1/score`` reply for ``n`` samples → ``{"components": {name: [float]}, "valid": [bool],
    "reasons": [str]}``, read strictly.

    The reply's shape must be exact, else ``ValueError`` or :class:`ReplyError` (the whole request is
    invalid): an object with 1 to :data:`MAX_COMPONENTS` components of ``n`` numbers or nulls each, ``n``
    booleans ``valid`` (JSON ``true`` / ``false``, not ``"false"`` or 0) and ``n`` strings ``reasons``.
    A sample the server calls valid whose value is null, not finite or beyond :data:`MAX_ABS_SCORE` is
    made invalid with a reason naming the component and the value; its other samples keep their scores.
    """
    reply = loads(data)
    if not isinstance(reply, dict):
        raise ValueError(f"the reply is a JSON {type(reply).__name__}, not a score object")
    missing = [k for k in ("components", "valid", "reasons") if k not in reply]
    if missing:
        raise ValueError(f"the reply has no {', '.join(missing)}")
    components, valid, reasons = reply["components"], reply["valid"], reply["reasons"]
    if not isinstance(components, dict) or not components:
        raise ValueError("components must be a non-empty object of {name: [score per sample]}")
    if len(components) > MAX_COMPONENTS:
        raise ValueError(f"the reply names {len(components)} components, over the limit of {MAX_COMPONENTS}")
    for field, value in (("valid", valid), ("reasons", reasons), *((f"component {k!r}", v) for k, v in
                                                                   components.items())):
        if not isinstance(value, list) or len(value) != n:
            size = len(value) if isinstance(value, list) else type(value).__name__
            raise ValueError(f"{one_line(field, 80)} holds {size} values for the request's {n} samples")
    if not all(type(v) is bool for v in valid):
        bad = next(v for v in valid if type(v) is not bool)
        raise ValueError(f"valid holds {one_line(repr(bad), 40)}; every entry must be true or false")
    if not all(isinstance(r, str) for r in reasons):
        raise ValueError("reasons must be strings, one per sample")
    values: dict[str, list[float]] = {}
    ok, why = list(valid), [one_line(r, MAX_REASON_CHARS) if not v else "" for r, v in zip(reasons, valid)]
    for name, column in components.items():
        if not name or len(name) > MAX_NAME_CHARS:
            raise ValueError(f"a component name must be 1 to {MAX_NAME_CHARS} characters")
        row = [_score_value(v, f"component {one_line(name, 80)!r} sample {i}") for i, v in enumerate(column)]
        for i, v in enumerate(row):
            if math.isfinite(v) and abs(v) <= MAX_ABS_SCORE:
                continue
            if ok[i]:
                ok[i] = False
                shown = "null" if math.isnan(v) and column[i] is None else one_line(repr(column[i]), 40)
                why[i] = f"the server sent {shown} for {one_line(name, 80)!r}, not a finite score"
            row[i] = math.nan  # masked, never a number that overflows a sum
        values[name] = row
    for i in range(n):
        if not ok[i] and not why[i]:
            why[i] = "marked invalid by the server (no reason given)"
    return {"components": values, "valid": ok, "reasons": why}


def _cat(parts: list[dict[str, Any]], device: torch.device) -> RewardOutput:
    """The replies of consecutive requests as one output (a component a part lacks is NaN there, and its
    samples invalid: their total is not known)."""
    names = list(dict.fromkeys(k for p in parts for k in p["components"]))
    valid: list[bool] = []
    reasons: list[str] = []
    for p in parts:
        lacking = [k for k in names if k not in p["components"]]
        for ok, reason in zip(p["valid"], p["reasons"]):
            if ok and lacking:
                ok, reason = False, f"the server's reply lacked the component {lacking[0]!r}"
            valid.append(ok)
            reasons.append(reason)
    components = {}
    for name in names:
        values = [v for p in parts for v in p["components"].get(name, [math.nan] * len(p["valid"]))]
        components[name] = torch.tensor(values, dtype=torch.float32, device=device)
    return RewardOutput(components, torch.tensor(valid, dtype=torch.bool, device=device),
                        [{"reason": r} if r else {} for r in reasons])


def _jsonable(value: Any) -> Any:
    """Metadata values JSON has no form for: a dataclass as its fields, anything else as text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)
