"""The VLM judge's HTTP client against servers that misbehave: a trickle, a flood, malformed chat replies.
Each request comes back as a completion with ``error`` set (its sample invalid upstream), within the
timeout, without reading a flood whole; nothing raises."""

from __future__ import annotations

import math
import time

import pytest

from flowalign.errors import UserError
from rewards import vlm_http
from rewards.vlm_backend import ChatRequest
from rewards.vlm_http import OpenAIChatClient, parse_chat_reply
from tests.fake_http import FakeServer, answer, flood, reset, trickle

SLACK_S = 3.0


def ask(srv: FakeServer, n: int = 2, **options) -> list:
    client = OpenAIChatClient(srv.url, model="judge", **{"timeout": 5, "retries": 0, **options})
    return client.complete([ChatRequest(messages=[{"role": "user", "content": "Rate it."}], max_tokens=4,
                                        top_logprobs=3)] * n)


def chat(content="Score: 7", positions=None, **choice) -> dict:
    out = {"choices": [{"message": {"role": "assistant", "content": content}, "finish_reason": "stop", **choice}],
           "usage": {"prompt_tokens": 12}}
    if positions is not None:
        out["choices"][0]["logprobs"] = {"content": positions}
    return out


def position(token="7", logprob=-0.1, alternatives=(("7", -0.1), ("8", -2.5))) -> dict:
    return {"token": token, "logprob": logprob,
            "top_logprobs": [{"token": t, "logprob": lp} for t, lp in alternatives]}


def assert_failed(completions, needle: str) -> None:
    for c in completions:
        assert c.text is None and c.error is not None and needle in c.error, c.error
        assert "\n" not in c.error


def test_a_good_reply_gives_its_exact_text_and_logprobs():
    with FakeServer(answer(chat(positions=[position()]))) as srv:
        completions = ask(srv)
    for c in completions:
        assert c.error is None and c.text == "Score: 7" and c.tokens == ["7"]
        assert c.top_logprobs == [[("7", -0.1), ("8", -2.5)]] and c.prompt_tokens == 12
    assert srv.bodies[0]["model"] == "judge" and srv.bodies[0]["top_logprobs"] == 3


def test_a_trickling_reply_is_cut_off_at_the_timeout():
    with FakeServer(trickle(declared=1000, every=0.5)) as srv:
        t0 = time.monotonic()
        completions = ask(srv, timeout=1.5)
        elapsed = time.monotonic() - t0
    assert_failed(completions, "timed out")
    assert elapsed < 1.5 + SLACK_S, elapsed  # the two requests run side by side


def test_a_retried_trickle_costs_each_attempt_its_timeout_only():
    with FakeServer(trickle(declared=1000, every=0.3)) as srv:
        t0 = time.monotonic()
        completions = ask(srv, n=1, timeout=1.0, retries=1, backoff=0.0)
        elapsed = time.monotonic() - t0
    assert_failed(completions, "failed after 2 attempts")
    assert elapsed < 2 * 1.0 + SLACK_S, elapsed


def test_a_huge_reply_is_not_read_whole(monkeypatch):
    with FakeServer(flood(declared=300 * 2**20)) as srv:
        assert_failed(ask(srv, n=1), f"declares {300 * 2**20} bytes")
        time.sleep(0.2)
    assert srv.sent < 50 * 2**20, srv.sent
    monkeypatch.setattr(vlm_http, "MAX_REPLY_BYTES", 2**20)
    with FakeServer(flood(declared=None, chunked=True)) as srv:
        assert_failed(ask(srv, n=1), f"over the client's cap of {2**20} bytes")
        time.sleep(0.2)
    assert srv.sent < 50 * 2**20, srv.sent


BAD_REPLIES = {
    "content a number": (chat(content=7), "message.content is int, not text"),
    "no choices": ({"choices": []}, "not a chat-completions reply"),
    "choices a string": ({"choices": "Score: 7"}, "not a chat-completions reply"),
    "logprob a string": (chat(positions=[position(alternatives=(("7", "-0.1"),))]), "str '-0.1', not a number"),
    "logprob a bool": (chat(positions=[position(alternatives=(("7", True),))]), "bool True, not a number"),
    "logprob a dict": (chat(positions=[position(alternatives=(("7", {"v": -1}),))]), "dict"),
    "logprob positive": (chat(positions=[position(alternatives=(("7", 3.0),))]), "not a log-probability"),
    "token a number": (chat(positions=[position(alternatives=((7, -0.1),))]), "token is int, not text"),
    "too many positions": (chat(positions=[position()] * 20_000), "20000 positions for max_tokens=4"),
    "too many alternatives": (chat(positions=[position(alternatives=[(str(i), -1.0) for i in range(20_000)])]),
                              "at most 3 alternatives"),
    "position a list": (chat(positions=[[1, 2]]), "logprobs.content[0] is not an object"),
    "content too long": (chat(content="x" * 100_000), "more than 4 tokens spell"),
    "not JSON": ("<html>bad gateway</html>", "not JSON"),
    "nested too deeply": ("[" * 200_000, "nested too deeply"),
}


@pytest.mark.parametrize("body, needle", BAD_REPLIES.values(), ids=BAD_REPLIES.keys())
def test_a_malformed_reply_is_that_requests_error(body, needle):
    with FakeServer(answer(body)) as srv:
        assert_failed(ask(srv, n=1), needle)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "1e309"])
def test_a_nan_or_positive_infinite_logprob_is_an_error(literal: str):
    body = ('{"choices": [{"message": {"content": "7"}, "logprobs": {"content": [{"token": "7", "logprob": -1, '
            '"top_logprobs": [{"token": "7", "logprob": %s}]}]}}]}' % literal)
    with FakeServer(answer(body)) as srv:
        assert_failed(ask(srv, n=1), "not a log-probability")


def test_minus_infinity_is_a_log_probability():
    data = chat(positions=[position(alternatives=(("7", -0.1), ("8", -math.inf)))])
    assert parse_chat_reply(data).top_logprobs == [[("7", -0.1), ("8", -math.inf)]]


def test_null_content_reads_as_empty_and_bad_usage_is_ignored():
    completion = parse_chat_reply({"choices": [{"message": {"content": None}}], "usage": {"prompt_tokens": "many"}})
    assert completion.text == "" and completion.prompt_tokens == 0 and completion.finish_reason == "stop"


@pytest.mark.parametrize("handler, needle", [
    (reset(), "ConnectionResetError"),
    (lambda srv, conn, body: srv.send(conn, b"HELLO\r\n\r\n"), "BadStatusLine"),
    (lambda srv, conn, body: srv.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 900\r\n\r\n{}"),
     "closed in the middle"),
    (answer({"error": {"message": "overloaded"}}, status=503, headers={"Retry-After": "-5"}), "HTTP 503: overloaded"),
    (answer({"error": {"message": "no"}}, status=401), "FLOWALIGN_API_KEY"),
])
def test_transport_failures_are_errors_not_exceptions(handler, needle):
    with FakeServer(handler) as srv:
        assert_failed(ask(srv, n=1), needle)


def test_a_models_list_without_a_name_is_an_error():
    with FakeServer(answer({"data": [{"id": {"name": "x"}}]})) as srv:
        client = OpenAIChatClient(srv.url, timeout=5, retries=0)
        (completion,) = client.complete([ChatRequest(messages=[{"role": "user", "content": "hi"}])])
    assert "lists no model" in completion.error


@pytest.mark.parametrize("option, value", [("timeout", math.nan), ("timeout", math.inf), ("backoff", -1),
                                           ("retries", 10**6), ("concurrency", 0), ("concurrency", True)])
def test_bad_options_are_refused_in_one_line(option, value):
    with pytest.raises(UserError, match=f"vlm_judge_http: {option}="):
        OpenAIChatClient("http://127.0.0.1:1/v1", **{option: value})
