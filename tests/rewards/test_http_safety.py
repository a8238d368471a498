"""``flowalign serve-judge`` against hostile clients, over real sockets on loopback.

One real server process (the tiny Qwen2.5-VL, a key from ``$FLOWALIGN_API_KEY``, 1 MiB bodies, 1 s to
send the headers and 1 s to send the body) faces a decompression bomb, oversized bodies, missing and
wrong keys, and clients that trickle their headers or body. Each gets its 4xx in OpenAI's error shape,
and the bomb is refused from its header: the process's peak memory does not grow by the image.
"""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import requests

from flowalign.cli.main import main as cli_main
from rewards.http_safety import API_KEY_ENV, BadRequest, Limits, PixelBudget, check_bind, open_image
from rewards.vlm_judge import HTTPVLMJudge

KEY = "test-key-0123456789"
#: a socket read that waits longer than this means the server held the connection (the test fails, never hangs)
PATIENCE = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving(args: list[str], env: dict[str, str]):
    """Start ``python -m flowalign ARGS --port P``, wait for its /health, yield (process, url, port), stop it."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flowalign", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                requests.get(url + "/health", timeout=1)
                break
            except requests.RequestException:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-2000:]
                time.sleep(0.2)
        yield proc, url, port
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def server(vlm_dir: Path):
    env = dict(os.environ, OMP_NUM_THREADS="1", **{API_KEY_ENV: KEY})
    yield from serving(["serve-judge", "--model", str(vlm_dir), "--max-body-mb", "1", "--header-timeout", "1",
                        "--body-timeout", "1"], env)


def peak_rss_kb(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def png_bomb(side: int, rows: int | None = None) -> bytes:
    """A valid 1-bit PNG of ``side``×``side`` black pixels: tens of KB that decode to ``3·side²`` RGB bytes
    (only its first ``rows`` rows, when given: a header that promises the rest)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\0" * (1 + (side + 7) // 8)  # filter byte + packed bits
    z = zlib.compressobj(9)
    idat = b"".join(z.compress(row) for _ in range(rows or side)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def chat_body(image: bytes | None = None, **fields) -> dict:
    parts = [{"type": "text", "text": "Rate this image."}]
    if image is not None:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        parts.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 1, **fields}


def post(url: str, body: dict, key: str | None = KEY) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=PATIENCE)


def openai_error(r: requests.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def raw_exchange(port: int, *pieces: bytes, pause: float = 0.0) -> bytes:
    """Send ``pieces`` with ``pause`` seconds between them (stopping if the server closes), then read the
    reply until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE) as s:
        for piece in pieces:
            try:
                s.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(pause)
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
    return reply


def status_of(reply: bytes) -> int:
    assert reply.startswith(b"HTTP/1.1 "), reply[:200]
    return int(reply.split(b" ", 2)[1])


def test_a_decompression_bomb_is_refused_from_its_header(server):
    proc, url, _ = server
    bomb = png_bomb(13000)  # 169 M pixels, ~0.5 GB as RGB
    assert len(bomb) < 400_000
    before = peak_rss_kb(proc.pid)
    error = openai_error(post(url, chat_body(bomb)), 413)
    assert "13000x13000" in error["message"] and "per image" in error["message"]
    assert error["param"] == "messages[0].content[0].image_url.url"
    # decoding it would have raised the peak by >= 169 MB (the 1-bit plane as bytes) + 507 MB (RGB)
    assert peak_rss_kb(proc.pid) - before < 50_000
    # past PIL's own bomb limit it is still a 413, not a 500
    error = openai_error(post(url, chat_body(png_bomb(30000, rows=10))), 413)  # the header is all it reads
    assert "30000x30000" in error["message"] or "too many pixels" in error["message"]


def test_pixels_are_capped_per_request_too():
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (100, 100)).save(buf, format="PNG")
    budget = PixelBudget(Limits(max_image_pixels=10_000, max_request_pixels=25_000))
    assert open_image(buf.getvalue(), budget, "a").size == (100, 100)
    open_image(buf.getvalue(), budget, "b")
    with pytest.raises(BadRequest, match="25000 pixels in all"):
        open_image(buf.getvalue(), budget, "c")
    with pytest.raises(BadRequest, match="readable"):
        open_image(b"GIF89a-not-really", PixelBudget(Limits()), "d")


def test_an_oversized_body_is_refused_before_it_is_read(server):
    _, _, port = server
    # 200 MB announced; only the headers are sent, and the 413 comes back without the body
    reply = raw_exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                         + b"\r\nContent-Type: application/json\r\nContent-Length: 209715200\r\n\r\n")
    assert status_of(reply) == 413 and b"request_too_large" in reply
    # a chunked upload declares no length: it is cut off once it passes the cap
    chunk = b"x" * 65536
    pieces = [b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
              + b"\r\nTransfer-Encoding: chunked\r\n\r\n"] + [b"10000\r\n" + chunk + b"\r\n"] * 40
    assert status_of(raw_exchange(port, *pieces)) == 413


def test_missing_or_wrong_key(server, vlm_dir: Path, monkeypatch):
    _, url, _ = server
    assert openai_error(post(url, chat_body(), key=None), 401)["code"] == "invalid_api_key"
    assert openai_error(post(url, chat_body(), key=KEY + "x"), 401)["type"] == "authentication_error"
    assert requests.get(url + "/v1/models", timeout=PATIENCE).status_code == 401
    assert requests.get(url + "/health", timeout=PATIENCE).status_code == 200  # for load balancers
    assert post(url, chat_body()).status_code == 200
    # the client sends the key from the same environment variable
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv(API_KEY_ENV, KEY)
    import torch

    x = torch.rand(1, 3, 32, 32)
    out = HTTPVLMJudge(url + "/v1", mode="text", max_tokens=2, retries=0, timeout=PATIENCE)(x, ["a"], [])
    assert out.info[0].get("reply") is not None
    monkeypatch.delenv(API_KEY_ENV)
    out = HTTPVLMJudge(url + "/v1", model=vlm_dir.name, mode="text", retries=0, timeout=PATIENCE)(x, ["a"], [])
    assert not out.valid.any() and API_KEY_ENV in out.info[0]["reason"]


def test_slow_headers_get_408_and_are_disconnected(server):
    _, _, port = server
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 30
    reply = raw_exchange(port, *[bytes([b]) for b in head], pause=0.1)  # one byte per 0.1 s: 5 s for the headers
    assert status_of(reply) == 408 and json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert status_of(raw_exchange(port, b"", pause=0)) == 408  # connects and sends nothing


def test_a_slow_body_gets_408(server):
    _, _, port = server
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    reply = raw_exchange(port, head, *[b"{"] * 40, pause=0.1)  # 1000 bytes announced, 1 per 0.1 s
    assert status_of(reply) == 408 and b"request body did not arrive" in reply


def test_a_long_prompt_is_refused_before_the_model_sees_it(server):
    _, url, _ = server
    started = time.monotonic()
    body = chat_body()
    body["messages"][0]["content"][0]["text"] = "word " * 60_000  # 300,000 characters: refused untokenized
    error = openai_error(post(url, body), 413)
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"]
    assert "serve-judge --max-prompt-tokens" in error["message"] and error["param"] == "messages"
    body["messages"][0]["content"][0]["text"] = "a " * 10_000  # short in characters, over 8,192 tokens
    error = openai_error(post(url, body), 413)
    assert "tokens of text" in error["message"] and error["code"] == "context_length_exceeded"
    assert time.monotonic() - started < 15  # the model would take minutes over either
    assert post(url, chat_body()).status_code == 200


def test_request_fields_are_validated(server):
    _, url, _ = server
    assert openai_error(post(url, chat_body(seed=2**80)), 400)["param"] == "seed"
    assert openai_error(post(url, chat_body(seed=-1)), 400)["param"] == "seed"
    assert openai_error(post(url, chat_body(max_tokens=True)), 400)["param"] == "max_tokens"
    assert openai_error(post(url, chat_body(temperature="hot")), 400)["param"] == "temperature"
    assert openai_error(post(url, chat_body(n=2)), 400)["param"] == "n"
    assert post(url, chat_body(seed=2**63 - 1)).status_code == 200
    r = requests.get(url + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"}, timeout=PATIENCE)
    openai_error(r, 404)


def test_binding_beyond_loopback_needs_a_key(vlm_dir: Path, capsys, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert cli_main(["serve-judge", "--model", str(vlm_dir), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0" in err and API_KEY_ENV in err and "--insecure-no-auth" in err and len(err.splitlines()) == 1
    check_bind("0.0.0.0", KEY, False, "serve-judge")  # a key, or the explicit override, lets it start
    check_bind("0.0.0.0", None, True, "serve-judge")
    for loopback in ("127.0.0.1", "localhost", "::1"):
        check_bind(loopback, None, False, "serve-judge")
