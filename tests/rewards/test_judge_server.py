"""``flowalign serve-judge`` and the HTTP judge, end to end over real HTTP on localhost.

The real server (FastAPI + uvicorn) serves the tiny Qwen2.5-VL in a thread; the client scores through
it and must agree with the in-process judge. Failures are real too: a closed port, a socket that
accepts and never answers, a server whose first replies are 503.
"""

from __future__ import annotations

import base64
import io
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import torch

from flowalign.cli.main import main as cli_main
from rewards.judge_server import BackgroundServer, create_app
from rewards.vlm_judge import HTTPVLMJudge, LocalVLMJudge

ALL = 10_000


@pytest.fixture(scope="module")
def local(vlm_dir: Path) -> LocalVLMJudge:
    return LocalVLMJudge(str(vlm_dir), mode="weighted", top_logprobs=ALL)


@pytest.fixture(scope="module")
def server(local: LocalVLMJudge):
    with BackgroundServer(create_app(local.backend, max_top_logprobs=ALL)) as srv:
        yield srv


def images(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.interpolate(torch.rand(n, 3, 8, 8, generator=g), size=(64, 64), mode="bilinear")


def png_url(seed: int = 0) -> str:
    from PIL import Image

    buf = io.BytesIO()
    array = (images(1, seed)[0].permute(1, 2, 0) * 255).round().byte().numpy()
    Image.fromarray(array).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(server, **body):
    body.setdefault("messages", [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_url()}}, {"type": "text", "text": "Rate this image."}]}])
    return requests.post(server.url + "/chat/completions", json=body, timeout=30)


def test_models_and_chat_completion_shape(server, vlm_dir: Path):
    models = requests.get(server.url + "/models", timeout=10).json()
    assert models["data"][0]["id"] == vlm_dir.name
    r = chat(server, model=vlm_dir.name, max_tokens=3, temperature=0, logprobs=True, top_logprobs=5)
    assert r.status_code == 200, r.text
    data = r.json()
    choice = data["choices"][0]
    assert data["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    content = choice["logprobs"]["content"]
    assert 1 <= len(content) <= 3 and all(len(pos["top_logprobs"]) == 5 for pos in content)
    # the greedy token is the most likely one, and log-probs are sorted and <= 0
    for pos in content:
        lps = [t["logprob"] for t in pos["top_logprobs"]]
        assert lps == sorted(lps, reverse=True) and lps[0] <= 0 and pos["logprob"] == pytest.approx(lps[0])
    assert data["usage"]["completion_tokens"] == len(content) and data["usage"]["prompt_tokens"] > 0


def test_temperature_zero_is_deterministic_and_seeded_sampling_reproducible(server):
    a, b = (chat(server, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3).json() for _ in range(2))
    assert a["choices"] == b["choices"]
    s1, s2 = (chat(server, max_tokens=6, temperature=1.5, seed=7).json()["choices"][0]["message"]["content"]
              for _ in range(2))
    assert s1 == s2


def test_http_judge_agrees_with_the_local_judge(local: LocalVLMJudge):
    x, prompts = images(6, seed=2), ["a red circle"] * 3 + ["two blue squares"] * 3
    # a long batching window, so that the concurrent requests surely share batches on a busy machine
    app = create_app(local.backend, max_top_logprobs=ALL, max_wait=0.5)
    with BackgroundServer(app) as srv:
        remote = HTTPVLMJudge(srv.url, mode="weighted", top_logprobs=ALL, concurrency=6)
        out = remote(x, prompts, [])
    ref = local(x, prompts, [])
    assert out.valid.all()
    # PNG over the wire is lossless: the same pixels, the same model, the same scores (up to batching)
    assert torch.allclose(out.components["vlm_judge_http"], ref.components["vlm_judge"], atol=1e-4)
    assert sum(app.state.batcher.batches) == 6 and max(app.state.batcher.batches) > 1  # batched on the server
    assert remote.backend.stats["requests"] == 6 and remote.backend.stats["failed"] == 0


def test_http_yesno(server, local: LocalVLMJudge):
    x, prompts = images(2, seed=4), ["a red circle"] * 2
    yesno = HTTPVLMJudge(server.url, model=local.backend.name, mode="yesno", top_logprobs=ALL)(x, prompts, [])
    s = yesno.components["vlm_judge_http"]
    assert yesno.valid.all() and ((s > 0) & (s < 1)).all()


def test_a_reply_that_is_not_a_score_over_http(server):
    judge = HTTPVLMJudge(server.url, mode="text", max_tokens=8)
    out = judge(images(3), ["a red circle"] * 3, [])
    assert not out.valid.any() and torch.isnan(out.components["vlm_judge_http"]).all()
    assert judge.stats["parse_failures"] == 3 and judge.stats["invalid"] == 3 and judge.backend.stats["failed"] == 0


def test_bad_requests_are_refused_with_a_message(server):
    r = chat(server, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]}])
    assert r.status_code == 400 and "data URL" in r.json()["error"]["message"]
    r = chat(server, logprobs=True, top_logprobs=ALL + 1)
    assert r.status_code == 400 and "top_logprobs" in r.json()["error"]["message"]
    r = chat(server, model="gpt-judge")
    assert r.status_code == 404 and "not served" in r.json()["error"]["message"]
    r = requests.post(server.url + "/chat/completions", data="not json", timeout=10,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    r = chat(server, continue_final_message=True)  # the last message is not an assistant prefix
    assert r.status_code == 400 and "continue_final_message" in r.json()["error"]["message"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_retries_then_invalid_in_bounded_time():
    judge = HTTPVLMJudge(f"http://127.0.0.1:{_free_port()}/v1", model="judge", timeout=2, retries=2, backoff=0.1)
    t0 = time.monotonic()
    out = judge(images(8), ["a red circle"] * 8, [])
    elapsed = time.monotonic() - t0
    assert not out.valid.any() and torch.isnan(out.components["vlm_judge_http"]).all()
    assert all("judge call failed" in x["reason"] for x in out.info) and judge.stats["call_failures"] == 8
    # one request spends the retry budget (0.1 + 0.2 s of backoff); the others stop retrying after it
    assert judge.backend.stats["retries"] >= 2 and judge.backend.stats["attempts"] < 8 * 3
    assert elapsed < 30, elapsed  # ~0.3 s of backoff; generous for a loaded machine, but no hanging on retries


def test_a_server_that_never_answers_times_out():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # accepts connections (the kernel does), never replies
    try:
        judge = HTTPVLMJudge(f"http://127.0.0.1:{listener.getsockname()[1]}", model="judge", timeout=0.5,
                             retries=1, backoff=0.05)
        t0 = time.monotonic()
        out = judge(images(4), ["a"] * 4, [])
        elapsed = time.monotonic() - t0
    finally:
        listener.close()
    assert not out.valid.any() and "timed out" in out.info[0]["reason"].lower()
    assert elapsed < 30, elapsed  # (1 + retries) x 0.5 s per request, in parallel; bounded, not hanging


def test_transient_503s_are_retried_with_backoff(local: LocalVLMJudge):
    """The real server behind a fault injector that answers 503 to the first two chat requests."""
    from starlette.responses import JSONResponse

    app = create_app(local.backend, max_top_logprobs=ALL)
    failures = {"left": 2}
    lock = threading.Lock()

    @app.middleware("http")
    async def flaky(request, call_next):
        with lock:
            fail = request.url.path.endswith("/chat/completions") and failures["left"] > 0
            failures["left"] -= fail
        if fail:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        return await call_next(request)

    with BackgroundServer(app) as srv:
        judge = HTTPVLMJudge(srv.url, mode="weighted", top_logprobs=ALL, retries=3, backoff=0.05, concurrency=1)
        out = judge(images(2), ["a red circle"] * 2, [])
    ref = local(images(2), ["a red circle"] * 2, [])
    assert out.valid.all() and judge.backend.stats["retries"] == 2
    assert torch.allclose(out.components["vlm_judge_http"], ref.components["vlm_judge"], atol=1e-5)


def test_serve_judge_command(vlm_dir: Path, tmp_path: Path, capsys):
    assert cli_main(["serve-judge", "--model", str(tmp_path / "nope"), "--port", "8000"]) == 2
    assert "not a model folder" in capsys.readouterr().err
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "flowalign", "serve-judge", "--model", str(vlm_dir), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        printed = ""
        while not printed.startswith("serving "):  # the address it prints is the one it listens on
            printed = proc.stdout.readline()
            assert printed or proc.poll() is None, "the server exited before saying where it listens"
        url = printed.split(" on ", 1)[1].split(" ", 1)[0]
        assert url.startswith("http://127.0.0.1:") and not url.startswith("http://127.0.0.1:0/")
        judge = HTTPVLMJudge(url, top_logprobs=20, timeout=60, retries=0)
        deadline = time.monotonic() + 90
        while True:
            try:
                requests.get(f"{url}/models", timeout=1)
                break
            except requests.RequestException:  # not listening yet, or listening but still loading (read timeout)
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-2000:]
                time.sleep(0.2)
        out = judge(images(1), ["a red circle"], [])
        assert out.info[0].get("reply") is not None  # an answer came back over HTTP (top-20 may miss the digits)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
