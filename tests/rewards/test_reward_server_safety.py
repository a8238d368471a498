"""``flowalign serve-reward`` against hostile clients, over real sockets on loopback: the same guards as
``serve-judge`` (:mod:`rewards.http_safety`), reached through the reward server's own request format.

One real server process (a pixel reward, a key from ``$FLOWALIGN_API_KEY``, 1 MiB bodies, 1 s to send the
headers and 1 s to send the body, at most 128x128 pixels per image) faces a PNG decompression bomb, an
MP4 whose frames are over the cap, oversized bodies, missing and wrong keys and trickling clients. Each
gets its 4xx in OpenAI's error shape naming ``serve-reward``'s flag, within a bounded time.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import pytest
import requests
import torch

from rewards.http_safety import API_KEY_ENV, Limits, PixelBudget
from rewards.reward_wire import decode_request, encode_samples
from tests.rewards.test_http_safety import (PATIENCE, openai_error, peak_rss_kb, png_bomb, raw_exchange, serving,
                                            status_of)

KEY = "reward-key-0123456789"
MAX_IMAGE_PIXELS = 128 * 128


@pytest.fixture(scope="module")
def server():
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo), **{API_KEY_ENV: KEY})
    yield from serving(["serve-reward", "{name: saturation}", "--max-body-mb", "1", "--header-timeout", "1",
                        "--body-timeout", "1", "--max-image-pixels", str(MAX_IMAGE_PIXELS)], env)


def score(url: str, body: dict, key: str | None = KEY) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(url + "/v1/score", json=body, headers=headers, timeout=PATIENCE)


def test_a_png_bomb_is_refused_from_its_header(server):
    proc, url, _ = server
    bomb = png_bomb(13000)
    before = peak_rss_kb(proc.pid)
    error = openai_error(score(url, {"prompts": ["a"], "images": [base64.b64encode(bomb).decode()]}), 413)
    assert "13000x13000" in error["message"] and error["param"] == "images[0]"
    assert peak_rss_kb(proc.pid) - before < 50_000  # decoding it would take > 600 MB
    # an image within the cap is scored: the refusal was the size, not the format
    small = encode_samples(torch.rand(1, 3, 64, 64), "png")
    assert score(url, {"prompts": ["a"], **small}).status_code == 200


def test_video_frames_over_the_cap_are_refused_from_the_stream_header(server):
    _, url, _ = server
    big = encode_samples(torch.rand(1, 2, 3, 144, 144), "mp4")  # 20,736 pixels a frame, over 16,384
    error = openai_error(score(url, {"prompts": ["a"], **big}), 413)
    assert "144x144" in error["message"] and "per image" in error["message"] and error["param"] == "videos[0]"
    # a clip within the cap decodes whole under the same limits (the served reward scores images, not clips)
    small = encode_samples(torch.rand(1, 2, 3, 64, 64), "mp4")
    samples, _, _ = decode_request({"prompts": ["a"], **small}, PixelBudget(Limits(max_image_pixels=MAX_IMAGE_PIXELS)))
    assert samples.shape == (1, 2, 3, 64, 64)


def test_an_oversized_body_gets_413_naming_the_flag(server):
    _, _, port = server
    reply = raw_exchange(port, b"POST /v1/score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                         + b"\r\nContent-Type: application/json\r\nContent-Length: 209715200\r\n\r\n")
    assert status_of(reply) == 413 and b"serve-reward --max-body-mb" in reply


def test_missing_or_wrong_key_gets_401(server):
    _, url, _ = server
    body = {"prompts": ["a"], **encode_samples(torch.rand(1, 3, 8, 8), "float32")}
    assert openai_error(score(url, body, key=None), 401)["code"] == "invalid_api_key"
    assert openai_error(score(url, body, key=KEY + "x"), 401)["type"] == "authentication_error"
    assert openai_error(requests.get(url + "/v1/reward", timeout=PATIENCE), 401)
    assert requests.get(url + "/health", timeout=PATIENCE).status_code == 200
    assert score(url, body).status_code == 200


def test_slow_clients_get_408_naming_the_flags(server):
    _, _, port = server
    head = b"POST /v1/score HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 30
    started = time.monotonic()
    reply = raw_exchange(port, *[bytes([b]) for b in head], pause=0.1)  # 5 s of headers against a 1 s deadline
    assert status_of(reply) == 408 and b"serve-reward --header-timeout" in reply
    head = (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    reply = raw_exchange(port, head, *[b"{"] * 40, pause=0.1)
    assert status_of(reply) == 408 and b"serve-reward --body-timeout" in reply
    assert time.monotonic() - started < PATIENCE  # neither connection was held


def test_a_video_bomb_is_refused_before_a_frame_is_read():
    """A 5 KB MP4 of one 4096x4096 frame (50 MB decoded): refused from the stream's header, so no frame's
    bytes ever reach this process (tracemalloc sees the bytes and arrays the reader would allocate)."""
    import tracemalloc

    import imageio.v3 as iio
    import numpy as np

    from rewards.http_safety import BadRequest

    bomb = iio.imwrite("<bytes>", np.zeros((1, 4096, 4096, 3), np.uint8), extension=".mp4", fps=8)
    assert len(bomb) < 50_000
    body = {"prompts": ["a"], "videos": [base64.b64encode(bomb).decode()]}
    tracemalloc.start()
    try:
        with pytest.raises(BadRequest, match="4096x4096 = 16777216 pixels, over the server's limit of 16384"):
            decode_request(body, PixelBudget(Limits(max_image_pixels=MAX_IMAGE_PIXELS)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000  # reading the frame would have taken 50 MB
