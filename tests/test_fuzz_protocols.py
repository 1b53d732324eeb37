"""Fuzzed bad input (hypothesis) on dew's two wire protocols: a SubprocessEnvironment worker's JSON lines, and
the OpenAI-compatible front's request bodies.

A worker's reply (valid, malformed, binary, partial, oversized, deeply nested) becomes
either the observation it encodes or an error observation naming what was wrong; it never
raises out of ``reset``, and a fresh environment afterwards still works. A request body
(any JSON, any bytes) gets a 200 or a 4xx whose JSON names the problem, never a 500, and
the server answers a valid request after it. Profiles as in tests/test_fuzz_inputs.py.
"""

import json
import os
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import story_server
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz_inputs import FUZZ, json_values

from dew.inference import OpenAIFront
from dew.records.episode_protocol import Action, EpisodeId, EpisodeStatus, Observation
from dew.sandbox import SandboxLimits, SubprocessEnvironment

WORKER = str(Path(__file__).resolve().parent / "workers" / "reply_worker.py")
LIMITS = SandboxLimits(wall_seconds=10.0, memory_bytes=256 << 20, message_bytes=1 << 14)
EPISODE = EpisodeId(task=1, step=0, sample=0, seed=0)
STATUSES = [status.value for status in EpisodeStatus]


def reply_objects():
    ids = st.lists(st.integers(0, 50), max_size=6)
    fields = {"context": st.one_of(ids, ids, ids, json_values), "status": st.one_of(*[st.sampled_from(STATUSES)] * 3,
                                                                                     json_values),
              "detail": st.one_of(st.text(max_size=20), json_values)}
    return st.fixed_dictionaries({}, optional={**fields, "extra": json_values})


def encoded(reply: dict, cut: int | None, trailer: bytes) -> bytes:
    line = json.dumps(reply).encode() + b"\n" + trailer
    return line if cut is None else line[:cut]


replies = st.one_of(
    st.builds(encoded, reply_objects(), st.none(), st.just(b"")),  # whole replies
    st.builds(encoded, reply_objects(), st.none(), st.binary(min_size=1, max_size=20)),  # a second line's bytes
    st.builds(encoded, reply_objects(), st.integers(0, 30), st.just(b"")),  # cut short
    st.binary(max_size=200),
    st.binary(max_size=200).map(lambda data: data + b"\n"),
    st.integers(LIMITS.message_bytes - 2, 3 * LIMITS.message_bytes).map(lambda n: b'{"context": "' + b"x" * n + b'"}\n'),
    st.integers(1, 8000).map(lambda depth: b'{"context": ' + b"[" * depth + b"]" * depth + b', "status": "running"}\n'),
)


def expected_observation(data: bytes) -> Observation | None:
    """The observation a reply encodes, or None where the protocol says it is an error."""
    line, newline, _ = data.partition(b"\n")
    if not newline or len(line) > LIMITS.message_bytes:
        return None
    try:
        reply = json.loads(line)
        if not isinstance(reply, dict) or not isinstance(reply.get("context"), list) or \
                not isinstance(reply.get("status"), str):
            return None
        return Observation(reply["context"], reply["status"], reply.get("detail", ""))
    except (ValueError, TypeError, RecursionError):
        return None


@FUZZ
@given(replies)
def test_a_worker_reply_is_its_observation_or_a_named_error(data):
    with tempfile.NamedTemporaryFile(suffix=".reply") as file:
        file.write(data)
        file.flush()
        with SubprocessEnvironment([sys.executable, WORKER, file.name], LIMITS)(EPISODE) as env:
            observation = env.reset()
            expected = expected_observation(data)
            if expected is None:
                assert observation.status is EpisodeStatus.ERROR and observation.detail, observation
                assert env.failure == observation
                assert env.step(Action((1,), (2,), eos=False, policy_step=0)) == observation  # ended, and stays so
            else:
                assert observation == expected
    good = Path(tempfile.gettempdir()) / f"dew-good-reply-{os.getpid()}"
    good.write_bytes(b'{"context": [7], "status": "running"}\n')
    with SubprocessEnvironment([sys.executable, WORKER, str(good)], LIMITS)(EPISODE) as env:
        assert env.reset() == Observation((7,), "running")


# ----- the OpenAI-compatible front --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def front():
    tokenizer, rollout = story_server(capacity=32, slots=2)
    with OpenAIFront(rollout, tokenizer=tokenizer) as http:
        yield http
    rollout.close()


def post(front, path: str, data: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(front.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


small = st.one_of(st.integers(-2, 40), st.floats(-1, 3), st.booleans(), st.none(), json_values)
request_fields = {
    "prompt": st.one_of(st.lists(st.integers(-1, 60), max_size=6), st.text(max_size=20),
                        st.lists(st.lists(st.integers(0, 60), max_size=4), max_size=2), json_values),
    "messages": st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                                          "content": st.text(max_size=20)}), max_size=3), json_values),
    "max_tokens": small, "temperature": small, "top_p": small, "top_k": small, "min_p": small, "seed": small,
    "n": small, "logprobs": small, "top_logprobs": small, "stream": small, "stop": st.one_of(
        st.text(max_size=4), st.lists(st.text(max_size=4), max_size=2), json_values),
    "model": st.one_of(st.just("story"), st.text(max_size=6)), "return_token_ids": small, "tools": json_values,
}
bodies = st.one_of(
    st.fixed_dictionaries({}, optional=request_fields).map(lambda body: json.dumps(body).encode()),
    json_values.map(lambda value: json.dumps(value).encode()),
    st.binary(max_size=100),
    st.integers(1, 30000).map(lambda depth: b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"),
)


@FUZZ
@given(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), bodies)
def test_a_request_body_is_answered_or_refused_by_name(front, path, data):
    status, reply = post(front, path, data)
    assert status in (200, 400, 404), (status, reply[:300])
    if status != 200:
        assert json.loads(reply)["error"]["message"]
    assert post(front, "/v1/completions", json.dumps({"prompt": [1, 2], "max_tokens": 2}).encode())[0] == 200
