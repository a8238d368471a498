"""``flowalign serve-reward`` and the ``remote`` reward, end to end over real HTTP on localhost.

The real server (FastAPI + uvicorn) serves a built-in reward in a thread; ``rewards.load("remote")``
scores through it and must agree with the reward in process. Failures are real too: a server that is
stopped, a socket that accepts and never answers, a reward that raises, a wrong key.
"""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch

import rewards
from flowalign.cli.main import main as cli_main
from flowalign.reward_set import RewardSet
from rewards.http_safety import Limits
from rewards.judge_server import BackgroundServer
from rewards.reward_server import create_app
from rewards.reward_wire import encode_samples


def images(n: int, size: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def serve(reward, name: str, **kwargs) -> BackgroundServer:
    return BackgroundServer(create_app(reward, name=name, **kwargs))


def base(srv: BackgroundServer) -> str:
    return f"http://{srv.host}:{srv.port}"


@pytest.fixture(scope="module")
def saturation_server():
    with serve(rewards.load("saturation"), "saturation") as srv:
        yield srv


def test_remote_float32_scores_equal_in_process(saturation_server):
    x, prompts = images(5), ["p"] * 5
    local = rewards.load("saturation")(x, prompts, [])
    # a batch over the request cap goes as several requests and comes back in order
    remote = rewards.load("remote", url=base(saturation_server), max_request_mb=3 * 24 * 24 * 4 * 2.5 / 2**20)
    out = remote(x, prompts, [])
    assert list(out.components) == list(local.components) == ["saturation"]
    torch.testing.assert_close(out.total, local.total, atol=1e-5, rtol=0)
    assert out.valid.all()


@pytest.mark.parametrize("encoding", ["uint8", "png"])
def test_quantised_encodings_equal_in_process_on_quantised_samples(saturation_server, encoding):
    x = images(3, seed=1)
    quantised = (x * 255).round() / 255  # what PNG and uint8 keep
    local = rewards.load("saturation")(quantised, ["p"] * 3, [])
    out = rewards.load("remote", url=base(saturation_server), encoding=encoding)(x, ["p"] * 3, [])
    torch.testing.assert_close(out.total, local.total, atol=1e-5, rtol=0)


def test_stopped_server_masks_the_batch_and_a_run_goes_on(capsys):
    srv = serve(rewards.load("brightness"), "brightness").start()
    remote = rewards.load("remote", url=base(srv), timeout=5)
    assert remote(images(2), ["a", "b"], []).valid.all()
    srv.stop()
    out = remote(images(2), ["a", "b"], [])
    assert not out.valid.any() and torch.isnan(out.components["brightness"]).all()  # masked, never 0
    assert base(srv) in out.info[0]["reason"]
    scores = RewardSet([("remote", 1.0, remote)]).score(images(2), ["a", "b"], [{}, {}])  # what the loop calls
    assert not scores.valid.any() and "remote" in scores.reasons[0]
    err = capsys.readouterr().err
    assert "samples are invalid" in err and "Traceback" not in err


def test_the_command_serves_until_killed(tmp_path):
    """``flowalign serve-reward`` as a user starts it; then the process is killed, as a crashed GPU box is."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "FLOWALIGN_API_KEY": "k3y"}
    proc = subprocess.Popen([sys.executable, "-m", "flowalign", "serve-reward", "{name: saturation}", "--port", str(port)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):  # until it listens (or has died)
            try:
                if requests.get(url + "/health", timeout=1).ok:
                    break
            except requests.ConnectionError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.1)
        remote = rewards.load("remote", url=url, api_key="k3y", timeout=5)
        x = images(3, seed=4)
        torch.testing.assert_close(remote(x, ["a"] * 3, []).total, rewards.load("saturation")(x, ["a"] * 3, []).total,
                                   atol=1e-5, rtol=0)
        assert requests.get(url + "/v1/reward", headers={"Authorization": "Bearer k3y"}, timeout=5).json()["name"] == \
            "saturation"
    finally:
        proc.kill()
        proc.wait()
    out = remote(x, ["a"] * 3, [])
    assert not out.valid.any() and url in out.info[0]["reason"]


def test_a_server_that_never_answers_times_out():
    with socket.socket() as sock:  # accepts connections (the kernel's backlog) and never replies
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        out = rewards.load("remote", url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=0.5)(
            images(2), ["a", "b"], [])
    assert not out.valid.any() and "timeout=0.5 s" in out.info[0]["reason"]


def test_reward_failure_and_wrong_key_are_invalid_with_their_reason():
    def broken(samples, prompts, metadata):
        raise RuntimeError("weights are corrupt")

    with serve(rewards.registry.FunctionReward("broken", broken), "broken") as srv:
        out = rewards.load("remote", url=base(srv))(images(1), ["a"], [])
        assert not out.valid.any() and "weights are corrupt" in out.info[0]["reason"]
    with BackgroundServer(create_app(rewards.load("brightness"), name="brightness", limits=Limits(api_key="k3y"))) as srv:
        assert "HTTP 401" in rewards.load("remote", url=base(srv))(images(1), ["a"], []).info[0]["reason"]
        assert rewards.load("remote", url=base(srv), api_key="k3y")(images(1), ["a"], []).valid.all()
        assert requests.get(base(srv) + "/health", timeout=10).status_code == 200  # no key needed


def test_bad_requests_are_refused_with_the_reason(saturation_server):
    url = base(saturation_server) + "/v1/score"
    small = Limits(max_image_pixels=16 * 16)
    with BackgroundServer(create_app(rewards.load("saturation"), name="saturation", limits=small)) as capped:
        r = requests.post(base(capped) + "/v1/score", json={"prompts": ["a"], **encode_samples(images(1), "float32")},
                          timeout=10)
        assert r.status_code == 413 and "pixels" in r.json()["error"]["message"]
    cases = [
        ({"prompts": ["a", "b"], **encode_samples(images(1), "float32")}, "1 samples for 2 prompts"),
        ({"prompts": ["a"], "tensor": base64.b64encode(b"\xff" * 8 + b"{}").decode()}, "header"),
        ({"prompts": ["a"], "images": ["not base64!"]}, "base64"),
        ({"prompts": ["a"]}, "exactly one of"),
        ({"prompts": ["a"], **encode_samples(torch.rand(1, 1, 8, 8), "float32")}, "(B, 3, H, W)"),
    ]
    for body, needle in cases:
        r = requests.post(url, json=body, timeout=10)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (needle, r.text)


def test_video_reward_served_with_float32_clips_equals_in_process():
    clips = torch.rand(2, 3, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    local = rewards.load("saturation_video")(clips, ["a", "b"], [])
    with serve(rewards.load("saturation_video"), "saturation_video") as srv:
        out = rewards.load("remote", url=base(srv))(clips, ["a", "b"], [])
    assert list(out.components) == list(local.components)
    torch.testing.assert_close(out.total, local.total, atol=1e-5, rtol=0)


def test_videos_travel_as_mp4_frames():
    from rewards.http_safety import PixelBudget
    from rewards.reward_wire import decode_request

    clip = torch.rand(1, 3, 3, 16, 16)
    samples, _, _ = decode_request({"prompts": ["a"], **encode_samples(clip, "mp4")}, PixelBudget(Limits()))
    assert samples.shape == (1, 3, 3, 16, 16) and samples.dtype == torch.float32


def test_a_served_reward_with_video_mp4_fps_scores_the_videos_it_receives_through_the_file(monkeypatch):
    import rewards.reward_server as reward_server
    from flowalign.video_file import Mp4RoundTrip, through_mp4

    served = {}
    monkeypatch.setattr(reward_server, "serve", lambda reward, **kw: served.update(reward=reward, **kw))
    assert cli_main(["serve-reward", "{name: saturation_video, video_mp4_fps: 16}", "--port", "0"]) == 0
    reward, clips = served["reward"], torch.rand(1, 3, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    assert isinstance(reward, Mp4RoundTrip) and served["spec"]["video_mp4_fps"] == 16
    expected = rewards.load("saturation_video")(through_mp4(clips, 16), ["a"], [])
    torch.testing.assert_close(reward(clips, ["a"], []).total, expected.total)


@pytest.mark.parametrize("argv, needle", [
    (["serve-reward", "brightness", "--host", "0.0.0.0"], "without a key"),
    (["serve-reward", "{name: brightness"], "not valid YAML"),
    (["serve-reward", "{name: brightness, bogus: 1}"], "has no option"),
    (["serve-reward", "{name: remote, url: 'http://x:1'}"], "not a remote one"),
    (["serve-reward", "{name: brightness, invalid_value: 0}"], "invalid_value is the client's choice"),
])
def test_serve_reward_refuses_in_one_line(argv, needle, capsys, monkeypatch):
    monkeypatch.delenv("FLOWALIGN_API_KEY", raising=False)
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_an_unknown_path_and_a_wrong_method_get_the_openai_error_shape(saturation_server):
    """Not starlette's plain-text pages: the same error object as every other refusal (``answer_errors_as_json``)."""
    from rewards.http_safety import error_body

    for response, status in [(requests.get(base(saturation_server) + "/v1/nope", timeout=10), 404),
                             (requests.get(base(saturation_server) + "/v1/score", timeout=10), 405)]:
        assert response.status_code == status
        error = response.json()["error"]
        assert error["message"] and error == {**error_body(status, error["message"])["error"], "code": error["code"]}
