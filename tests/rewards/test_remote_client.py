"""The ``remote`` reward against servers that misbehave: they trickle, flood, reset, or reply with something
that is not a score reply. Every such batch comes back masked (NaN, invalid, a one-line reason), within
the timeout, without reading a flood whole, and nothing raises out of the reward."""

from __future__ import annotations

import json
import math
import ssl
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

import rewards
from flowalign.errors import UserError
from flowalign.reward_set import RewardSet
from rewards import http_client
from rewards.remote import MAX_COMPONENTS, parse_score_reply
from tests.fake_http import FakeServer, answer, flood, reset, trickle

N = 2
#: how late past its timeout a call may return on a loaded machine (the bound is the timeout, not this)
SLACK_S = 3.0


def images(n: int = N) -> torch.Tensor:
    return torch.rand(n, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def score(srv: FakeServer, n: int = N, **options) -> rewards.Reward:
    return rewards.load("remote", url=srv.url, **{"timeout": 5, **options})(images(n), ["a"] * n, [])


def good(values=(0.25, -3.0), **extra) -> dict:
    return {"name": "r", "components": {"r": list(values)}, "valid": [True] * len(values),
            "reasons": [""] * len(values), **extra}


def assert_masked(out, needle: str) -> None:
    assert not out.valid.any()
    assert all(torch.isnan(v).all() for v in out.components.values())  # masked, never scored 0
    reason = out.info[0]["reason"]
    assert needle in reason, reason
    assert "\n" not in reason and len(reason) < 700


def test_a_good_reply_gives_its_exact_scores():
    reply = {"name": "r", "components": {"a": [0.25, -3], "b": [1e-3, 2.5]}, "valid": [True, True],
             "reasons": ["", ""]}
    with FakeServer(answer(reply)) as srv:
        out = score(srv)
    assert out.valid.all() and list(out.components) == ["a", "b"]
    assert out.components["a"].tolist() == [0.25, -3.0]
    assert out.components["b"].tolist() == [torch.tensor(1e-3).item(), 2.5]
    assert srv.bodies[0]["prompts"] == ["a", "a"] and "tensor" in srv.bodies[0]


def test_a_trickling_reply_is_cut_off_at_the_timeout():
    """Content-Length, then one byte every half second: each read is quick, the reply never completes."""
    with FakeServer(trickle(declared=1000, every=0.5)) as srv:
        t0 = time.monotonic()
        out = score(srv, timeout=1.5)
        elapsed = time.monotonic() - t0
    assert_masked(out, "timeout=1.5 s")
    assert elapsed < 1.5 + SLACK_S, elapsed  # a per-read timeout would wait ~500 s here


def test_trickling_headers_are_cut_off_at_the_timeout():
    with FakeServer(trickle(declared=10, every=0.2, in_headers=True)) as srv:
        t0 = time.monotonic()
        out = score(srv, timeout=1.0)
        elapsed = time.monotonic() - t0
    assert_masked(out, "timed out")
    assert elapsed < 1.0 + SLACK_S, elapsed


def test_a_declared_huge_reply_is_refused_unread():
    with FakeServer(flood(declared=300 * 2**20)) as srv:
        out = score(srv, max_reply_mb=1)
        time.sleep(0.2)  # let the server notice the close
    assert_masked(out, f"declares {300 * 2**20} bytes")
    assert srv.sent < 50 * 2**20, srv.sent  # what the socket buffers took, not the 300 MB


@pytest.mark.parametrize("chunked", [False, True], ids=["until-close", "chunked"])
def test_an_undeclared_flood_is_cut_off_at_the_cap(chunked: bool):
    with FakeServer(flood(declared=None, chunked=chunked)) as srv:
        out = score(srv, max_reply_mb=1)
        time.sleep(0.2)
    assert_masked(out, f"over the client's cap of {2**20} bytes")
    assert srv.sent < 50 * 2**20, srv.sent


BAD_REPLIES = {
    "string score": (good(["0.5", "0.5"]), "str '0.5', not a number"),
    "dict score": (good([{"v": 1}, 0.5]), "dict"),
    "bool score": (good([True, 0.5]), "bool True, not a number"),
    "string valid": ({**good(), "valid": ["false", True]}, "valid holds 'false'"),
    "int valid": ({**good(), "valid": [1, 1]}, "valid holds 1"),
    "20000 components": ({**good(), "components": {f"c{i}": [0.0, 0.0] for i in range(20_000)}},
                         f"over the limit of {MAX_COMPONENTS}"),
    "no components": ({**good(), "components": {}}, "non-empty object"),
    "short component": (good([0.5]) | {"valid": [True, True], "reasons": ["", ""]}, "holds 1 values"),
    "long valid": ({**good(), "valid": [True] * 3}, "valid holds 3 values for the request's 2 samples"),
    "reasons not text": ({**good(), "reasons": [None, None]}, "reasons must be strings"),
    "no reasons": ({k: v for k, v in good().items() if k != "reasons"}, "has no reasons"),
    "a list": ([0.5, 0.5], "JSON list, not a score object"),
    "not JSON": ("<html>bad gateway</html>", "not JSON"),
    "bad UTF-8": (b"\xff\xfe{}", "not JSON"),
    "nested too deeply": ("[" * 200_000, "nested too deeply"),
    "integer too long": ('{"components": {"r": [' + "9" * 5000 + ", 1]}}", "not JSON"),
}


@pytest.mark.parametrize("body, needle", BAD_REPLIES.values(), ids=BAD_REPLIES.keys())
def test_a_malformed_reply_masks_the_batch_with_its_reason(body, needle, capsys):
    with FakeServer(answer(body)) as srv:
        out = score(srv)
    assert_masked(out, needle)
    assert srv.url in out.info[0]["reason"]
    err = capsys.readouterr().err
    assert "samples are invalid" in err and "Traceback" not in err


@pytest.mark.parametrize("literal, shown", [("NaN", "nan"), ("Infinity", "inf"), ("-Infinity", "-inf"),
                                            ("1e309", "inf"), ("-1e31", "-1e+31"), ("null", "null")])
def test_a_non_finite_or_absurd_score_makes_its_sample_invalid_only(literal: str, shown: str):
    body = '{"components": {"r": [%s, 0.5]}, "valid": [true, true], "reasons": ["", ""]}' % literal
    with FakeServer(answer(body)) as srv:
        out = score(srv)
        scores = RewardSet([("remote", 1.0, rewards.load("remote", url=srv.url))]).score(images(), ["a"] * N,
                                                                                          [{}] * N)
    assert out.valid.tolist() == [False, True]
    assert math.isnan(out.components["r"][0]) and out.components["r"][1].item() == 0.5
    assert out.info[0]["reason"] == f"the server sent {shown} for 'r', not a finite score"
    assert scores.valid.tolist() == [False, True] and scores.total[1].item() == 0.5  # what the loop sees


def test_the_servers_own_invalid_samples_keep_their_reason():
    body = {"components": {"r": [None, 0.5]}, "valid": [False, True], "reasons": ["no face\nfound", ""]}
    with FakeServer(answer(body)) as srv:
        out = score(srv)
    assert out.valid.tolist() == [False, True] and out.info[0]["reason"] == "no face found"


@pytest.mark.parametrize("handler, needle", [
    (reset(), "ConnectionResetError"),
    (reset(b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{\"compo"), "ConnectionResetError"),
    (lambda srv, conn, body: srv.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n{}"),
     "closed in the middle of the reply (2 bytes read)"),
    (lambda srv, conn, body: srv.send(conn, b"HELLO\r\n\r\n"), "BadStatusLine"),
    (lambda srv, conn, body: None, "RemoteDisconnected"),  # closed without a word
    (answer({"error": {"message": "CUDA out of memory\nat line 3"}}, status=500), "HTTP 500: CUDA out of memory"),
    (answer({"error": {"message": "bad key"}}, status=401), "set $FLOWALIGN_API_KEY"),
    (answer(b"\x00" * 10_000, status=502), "HTTP 502"),
])
def test_transport_failures_mask_the_batch_and_never_raise(handler, needle):
    with FakeServer(handler) as srv:
        out = score(srv)
        scores = RewardSet([("remote", 1.0, rewards.load("remote", url=srv.url, timeout=5))]).score(
            images(), ["a"] * N, [{}] * N)
    assert_masked(out, needle)
    assert not scores.valid.any() and "remote" in scores.reasons[0]


def test_a_refused_connection_is_said_so():
    with FakeServer(answer(good())) as srv:
        url = srv.url
    out = rewards.load("remote", url=url, timeout=5)(images(), ["a"] * N, [])
    assert_masked(out, "connection refused")


def test_metadata_with_nan_and_objects_is_sent_as_strict_json():
    with FakeServer(answer(good())) as srv:
        out = rewards.load("remote", url=srv.url, timeout=5)(images(), ["a"] * N,
                                                             [{"x": math.nan, "t": (1, 2)}, {"y": {1, 2}}])
    assert out.valid.all()
    assert srv.bodies[0]["metadata"][0] == {"x": None, "t": [1, 2]}


def test_a_later_failure_keeps_the_served_component_names():
    replies = iter([json.dumps(good()).encode(), b"nope"])

    def handler(srv, conn, body):
        raw = next(replies)
        srv.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)

    with FakeServer(handler) as srv:
        remote = rewards.load("remote", url=srv.url, timeout=5)
        assert remote(images(), ["a"] * N, []).valid.all()
        out = remote(images(), ["a"] * N, [])
    assert list(out.components) == ["r"]  # the same names as the good batches: the loop logs one column
    assert_masked(out, "not JSON")


def test_parse_score_reply_reads_parts_and_a_part_lacking_a_component_is_invalid():
    part = parse_score_reply(json.dumps(good([1.0])).encode(), 1)
    assert part == {"components": {"r": [1.0]}, "valid": [True], "reasons": [""]}
    from rewards.remote import _cat

    other = {"components": {"s": [2.0]}, "valid": [True], "reasons": [""]}
    out = _cat([part, other], torch.device("cpu"))
    assert out.valid.tolist() == [False, False] and "lacked the component" in out.info[0]["reason"]


@pytest.mark.parametrize("option, value", [("timeout", 0), ("timeout", math.inf), ("timeout", 1e9),
                                           ("max_reply_mb", 0), ("max_reply_mb", 1e9), ("max_reply_mb", "16"),
                                           ("max_request_mb", math.nan)])
def test_bad_options_are_refused_in_one_line(option, value):
    with pytest.raises(UserError, match=f"remote reward: {option}="):
        rewards.load("remote", url="http://127.0.0.1:1", **{option: value})


@pytest.fixture
def tls_cert(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, trusted by the client as requests would ($REQUESTS_CA_BUNDLE)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
    http_client._tls_context.cache_clear()
    yield cert, key
    http_client._tls_context.cache_clear()


@pytest.mark.requires_program("openssl", install="apt-get install openssl")
def test_https_scores_and_a_trickled_tls_handshake_times_out(tls_cert):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            raw = json.dumps(good()).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args):
            pass

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*tls_cert)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"https://127.0.0.1:{server.server_address[1]}"
        out = rewards.load("remote", url=url, timeout=10)(images(), ["a"] * N, [])
        assert out.valid.all() and out.components["r"].tolist() == [0.25, -3.0]
    finally:
        server.shutdown()
        server.server_close()

    def handshake_trickle(srv, conn, body):  # a TLS record header declaring 16 KB, then a byte at a time
        for byte in [b"\x16", b"\x03", b"\x03", b"\x40", b"\x00"] + [b"\x02"] * 100:
            if srv.stop.wait(0.3):
                return
            srv.send(conn, byte)

    with FakeServer(handshake_trickle, read_request=False) as srv:
        t0 = time.monotonic()
        out = rewards.load("remote", url=srv.url.replace("http:", "https:"), timeout=1.0)(images(), ["a"] * N, [])
        elapsed = time.monotonic() - t0
    assert_masked(out, "timed out")
    assert elapsed < 1.0 + SLACK_S, elapsed
