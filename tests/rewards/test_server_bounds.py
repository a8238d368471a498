"""``flowalign serve-reward`` bounded in memory and time, as real processes on loopback.

A plug-in reward written here (``probe_reward:probe``) hangs, sleeps, raises ``SystemExit`` or
``KeyboardInterrupt``, or scores, as its prompt says, and logs every call it gets. Against it: the
deadline of every call (504, then the next call is served), the limit on abandoned calls (503 for new
work, the GET endpoints still answering), a client that leaves before its call starts (the call never
runs), half-open sockets (``/health`` and authenticated requests still answered), JSON 500s, a
safetensors header declaring absurd shapes (refused in one step), the decode budget (a request over
it refused before decoding, concurrent requests decoded within it) and ``--port 0``.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import torch

from rewards.http_safety import API_KEY_ENV, BadRequest, DecodeBudget, Limits, PixelBudget
from rewards.reward_wire import decode_tensor, encode_samples
from tests.rewards.test_http_safety import openai_error, peak_rss_kb

KEY = "bounds-key-0123456789"
#: a socket read that waits longer than this means the server held the connection
PATIENCE = 30.0
REPO = Path(__file__).resolve().parents[2]

PLUGIN = '''
import os
import time

import torch

from flowalign.protocols import RewardOutput


def probe(samples, prompts, metadata):
    with open(os.environ["PROBE_LOG"], "a") as f:
        f.write(prompts[0] + "\\n")
    if prompts[0] == "hang":
        time.sleep(3600)
    if prompts[0] == "exit":
        raise SystemExit(3)
    if prompts[0] == "interrupt":
        raise KeyboardInterrupt
    if prompts[0].startswith("sleep "):
        time.sleep(float(prompts[0].split()[1]))
    return RewardOutput({"mean": samples.flatten(1).mean(1)}, torch.ones(len(prompts), dtype=torch.bool))
'''


def start(folder: Path, timeout_s: float, *flags: str):
    """``serve-reward {name: probe_reward:probe, timeout_s: T} --port 0 FLAGS`` with a key; yields
    ``(process, url, printed line)`` once it answers /health, then stops it."""
    (folder / "probe_reward.py").write_text(PLUGIN)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{folder}{os.pathsep}{REPO}",
               PROBE_LOG=str(folder / "calls.log"), **{API_KEY_ENV: KEY})
    proc = subprocess.Popen([sys.executable, "-m", "flowalign", "serve-reward",
                             f"{{name: 'probe_reward:probe', timeout_s: {timeout_s}}}", "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=folder)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while not any(line.startswith("serving reward") for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-2000:]
            time.sleep(0.05)
        printed = next(line for line in lines if line.startswith("serving reward"))
        url = re.search(r" on (http://\S+) \(", printed).group(1)
        while True:
            try:
                requests.get(url + "/health", timeout=1)
                break
            except requests.RequestException:
                assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-2000:]
                time.sleep(0.1)
        yield proc, url, printed
    finally:
        proc.kill()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def probe_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("probe")
    for proc, url, printed in start(folder, 2, "--max-connections", "4", "--header-timeout", "2"):
        yield proc, url, printed, folder / "calls.log"


def score(url: str, prompt: str, samples: torch.Tensor | None = None, **body) -> requests.Response:
    body = body or encode_samples(torch.rand(1, 3, 8, 8) if samples is None else samples, "float32")
    n = len(body["images"]) if "images" in body else 1
    return requests.post(url + "/v1/score", json={"prompts": [prompt] * n, **body},
                         headers={"Authorization": f"Bearer {KEY}"}, timeout=PATIENCE)


def reward_info(url: str) -> dict:
    r = requests.get(url + "/v1/reward", headers={"Authorization": f"Bearer {KEY}"}, timeout=PATIENCE)
    assert r.status_code == 200, r.text
    return r.json()


def test_port_0_prints_the_port_it_listens_on(probe_server):
    _, url, printed, _ = probe_server
    port = int(url.rsplit(":", 1)[1])
    assert port != 0 and f"url: 'http://127.0.0.1:{port}'" in printed and "timeout_s=2" in printed
    assert requests.get(url + "/health", timeout=PATIENCE).json() == {"status": "ok"}


def test_a_plugin_raising_systemexit_or_keyboardinterrupt_is_a_json_500(probe_server):
    _, url, _, _ = probe_server
    for prompt, kind in (("exit", "SystemExit"), ("interrupt", "KeyboardInterrupt")):
        error = openai_error(score(url, prompt), 500)
        assert kind in error["message"] and "probe_reward:probe" in error["message"]
    assert score(url, "fine").status_code == 200  # the server lives on


def _safetensors(header: str, data: bytes = b"") -> str:
    raw = header.encode()
    raw += b" " * (-len(raw) % 8)
    return base64.b64encode(struct.pack("<Q", len(raw)) + raw + data).decode()


def test_absurd_tensor_headers_are_refused_at_once_with_json(probe_server):
    _, url, _, _ = probe_server
    started = time.monotonic()
    cases = [  # (the shape as JSON text, status, words of the message)
        ("[67108864, 3, 1, 1]", 413, "pixels in all"),
        ("[1000000000000000000000000000000, 3, 100000, 100000]", 413, "per image"),
        ("[1, 3, 1e400, 4]", 400, "list of integers"),
        ('[1, 3, "4", 4]', 400, "list of integers"),
        ("[1, 3, true, 4]", 400, "list of integers"),
        ("[1, 3, 4, 4]", 400, "needs 48"),  # the header promises bytes the data does not hold
    ]
    for shape, status, words in cases:
        tensor = _safetensors(f'{{"samples": {{"dtype": "U8", "shape": {shape}, "data_offsets": [0, 8]}}}}', b"\0" * 8)
        error = openai_error(score(url, "a", tensor=tensor), status)
        assert words in error["message"] and error["param"] == "tensor", (shape, error)
    assert time.monotonic() - started < 10  # each is one check of the header, not a loop over its shape
    # the same declared shape under the old per-request cap, which it fits: refused by its data length
    with pytest.raises(BadRequest, match="needs 201326592"):
        raw = base64.b64decode(_safetensors('{"samples": {"dtype": "U8", "shape": [67108864, 3, 1, 1], '
                                            '"data_offsets": [0, 201326592]}}'))
        decode_tensor(raw, PixelBudget(Limits(max_request_pixels=4 * 4096 * 4096)))
    # a well-formed tensor built the same way is scored: the refusals above were the header's
    good = _safetensors('{"samples": {"dtype": "U8", "shape": [1, 3, 2, 2], "data_offsets": [0, 12]}}', bytes(range(12)))
    assert score(url, "a", tensor=good).json()["components"]["mean"] == [pytest.approx(5.5 / 255)]


def test_a_hanging_reward_gets_a_504_at_its_deadline_and_the_next_call_is_served(probe_server):
    _, url, _, _ = probe_server
    before = reward_info(url)["abandoned_calls"]
    started = time.monotonic()
    error = openai_error(score(url, "hang"), 504)
    assert time.monotonic() - started < 12  # timeout_s=2, with room for a loaded machine
    assert error["code"] == "reward_timeout" and "timeout_s=2" in error["message"]
    info = reward_info(url)
    assert info["timeout_s"] == 2 and info["abandoned_calls"] == before + 1
    assert score(url, "fine").status_code == 200


def _send_and_leave(port: int, prompt: str, wait: float) -> None:
    body = json.dumps({"prompts": [prompt], **encode_samples(torch.rand(1, 3, 8, 8), "float32")}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE) as s:
        s.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        time.sleep(wait)


def test_a_client_that_leaves_before_its_call_starts_cancels_it(probe_server):
    _, url, _, log = probe_server
    port = int(url.rsplit(":", 1)[1])
    busy = threading.Thread(target=score, args=(url, "sleep 1.5"))
    busy.start()  # holds the reward for 1.5 s: the next calls wait their turn
    time.sleep(0.3)
    leavers = [threading.Thread(target=_send_and_leave, args=(port, f"gone {i}", 0.4)) for i in range(3)]
    for t in leavers:
        t.start()
    for t in leavers + [busy]:
        t.join()
    assert score(url, "after").status_code == 200
    calls = log.read_text().splitlines()
    assert "sleep 1.5" in calls and "after" in calls
    assert not [c for c in calls if c.startswith("gone")]  # each would have run within its 2 s deadline


def test_half_open_sockets_do_not_starve_health_or_authenticated_clients(probe_server):
    _, url, _, _ = probe_server
    port = int(url.rsplit(":", 1)[1])
    idle = []
    for _ in range(20):  # five times --max-connections 4, each stopped in the middle of its headers
        s = socket.create_connection(("127.0.0.1", port), timeout=PATIENCE)
        s.sendall(b"GET /health HTTP/1.1\r\nHo")
        idle.append(s)
    time.sleep(0.2)
    try:
        assert requests.get(url + "/health", timeout=5).status_code == 200
        assert reward_info(url)["name"] == "probe_reward:probe"
        assert score(url, "fine").status_code == 200
        # the oldest idle sockets were closed to make room (the server sent its FIN: recv gives b"")
        closed = 0
        for s in idle[:10]:
            s.settimeout(5)
            try:
                closed += s.recv(4096) == b""
            except ConnectionResetError:
                closed += 1
        assert closed == 10
    finally:
        for s in idle:
            s.close()


def test_abandoned_calls_past_the_limit_refuse_new_work_but_get_endpoints_answer(tmp_path):
    for proc, url, _ in start(tmp_path, 0.5):
        for _ in range(4):  # the server's limit of abandoned calls still running
            assert score(url, "hang").status_code == 504
        replies: list[int] = []
        crowd = [threading.Thread(target=lambda: replies.append(score(url, "hang").status_code)) for _ in range(50)]
        for t in crowd:  # more than the 40 threads of the server's pool
            t.start()
        for t in crowd:
            t.join()
        assert replies == [503] * 50
        error = openai_error(score(url, "fine"), 503)
        assert "4 calls past their deadline" in error["message"] and error["code"] == "server_busy"
        assert requests.get(url + "/health", timeout=5).json() == {"status": "ok"}
        assert reward_info(url)["abandoned_calls"] == 4
        assert (tmp_path / "calls.log").read_text().splitlines() == ["hang"] * 4  # the crowd ran nothing


def _png(side: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (200, 30, 40)).save(buf, format="PNG")  # a few KB that decode to MBs
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def budget_server(tmp_path_factory):
    yield from start(tmp_path_factory.mktemp("budget"), 60, "--max-decoded-mb", "100")


def test_a_request_over_the_budgets_is_refused_before_it_is_decoded(budget_server):
    proc, url, _ = budget_server
    before = peak_rss_kb(proc.pid)
    # four 4000x4000 PNGs of a few KB: 64 M pixels, over the default 16.8 M a request
    error = openai_error(score(url, "a", images=[_png(4000)] * 4), 413)
    assert "--max-request-pixels" in error["message"]
    # four 2000x2000: within the pixel cap, but 183 MiB as float32 against this server's 100
    error = openai_error(score(url, "a", images=[_png(2000)] * 4), 413)
    assert "--max-decoded-mb" in error["message"] and error["code"] == "request_too_large"
    assert peak_rss_kb(proc.pid) - before < 30_000  # decoding either would take >= 183 MB


def test_concurrent_requests_are_decoded_within_the_shared_budget(budget_server):
    proc, url, _ = budget_server
    before = peak_rss_kb(proc.pid)
    replies: list[requests.Response] = []
    # each request: 2 x 1500 x 1500 pixels = 51 MiB as float32, +15 MiB decoding: one fits in 100 MiB, two do not
    crowd = [threading.Thread(target=lambda: replies.append(score(url, "a", images=[_png(1500)] * 2)))
             for _ in range(4)]
    for t in crowd:
        t.start()
    for t in crowd:
        t.join()
    assert [r.status_code for r in replies] == [200] * 4, [r.text[:200] for r in replies]
    assert replies[0].json()["components"]["mean"][0] == pytest.approx((200 + 30 + 40) / 3 / 255, abs=1e-4)
    assert peak_rss_kb(proc.pid) - before < 170_000  # all four at once would hold > 260 MB


def test_the_decode_budget_refuses_what_never_fits_and_waits_for_what_will():
    budget = DecodeBudget(Limits(max_decoded_bytes=100, decode_wait_s=0.3))
    first = budget.open()
    first.grow(60, "a")
    with pytest.raises(BadRequest, match="over the server's") as e:
        budget.open().grow(101, "b")
    assert e.value.status == 413
    with pytest.raises(BadRequest, match="decoding other requests") as e:
        budget.open().grow(50, "c")  # 60 + 50 > 100: waits 0.3 s for the first, which stays
    assert e.value.status == 503
    threading.Timer(0.1, first.release).start()
    second = budget.open()
    second.grow(50, "d")  # the first is released while it waits
    assert budget.used == 50
    second.release()
    second.release()  # idempotent
    assert budget.used == 0


def test_whatever_an_app_raises_comes_back_as_a_json_500():
    from rewards.judge_server import BackgroundServer

    async def app(scope, receive, send):  # an ASGI app failing as no handler foresaw
        raise OverflowError("cannot convert float infinity to integer")

    with BackgroundServer(app, limits=Limits()) as server:
        error = openai_error(requests.get(f"http://127.0.0.1:{server.port}/v1/anything", timeout=PATIENCE), 500)
    assert error["message"] == "OverflowError: cannot convert float infinity to integer"
    assert error["type"] == "server_error"


def test_requests_past_the_limit_get_503_and_health_still_answers():
    import asyncio

    from rewards.judge_server import BackgroundServer

    async def app(scope, receive, send):  # every request but /health takes a second
        if scope["path"] != "/health":
            await asyncio.sleep(1.0)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"done"})

    with BackgroundServer(app, limits=Limits(max_connections=1)) as server:
        url = f"http://127.0.0.1:{server.port}"
        first = threading.Thread(target=requests.get, args=(url + "/slow",), kwargs={"timeout": PATIENCE})
        first.start()
        time.sleep(0.3)
        error = openai_error(requests.get(url + "/slow", timeout=PATIENCE), 503)
        assert "--max-connections" in error["message"] and error["code"] == "server_busy"
        assert requests.get(url + "/health", timeout=PATIENCE).text == "done"
        first.join()
        assert requests.get(url + "/slow", timeout=PATIENCE).text == "done"  # its slot is free again
