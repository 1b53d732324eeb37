import json
import socket
import urllib.error
import urllib.request

import jax
import jax.numpy as jnp
import pytest
from conftest import story_server

from dew.inference import OpenAIFront
from dew.sampling import Sampling


@pytest.fixture(scope="module")
def front():
    tokenizer, rollout = story_server(capacity=64)
    with OpenAIFront(rollout, tokenizer=tokenizer) as http:
        yield http
    rollout.close()


def call(front, path, body=None):
    request = urllib.request.Request(front.url + path, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_health_models_and_loopback(front):
    assert front.url.startswith("http://127.0.0.1:")
    assert call(front, "/health") == (200, {"status": "ok", "version": 0})
    status, models = call(front, "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "dew"


def test_completions_return_the_ids_and_log_probs_of_the_python_call(front):
    prompt = [5, 6, 7, 8]
    status, reply = call(front, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "seed": 11, "logprobs": 0,
                                                     "return_tokens_as_token_ids": True})
    assert status == 200
    choice = reply["choices"][0]
    direct = front.rollout.submit(prompt, 6, seed=11).result(timeout=60)
    assert choice["logprobs"]["tokens"] == [f"token_id:{i}" for i in direct.ids]
    assert choice["logprobs"]["token_logprobs"] == direct.behavior_log_probs
    assert choice["dew"]["raw_logprobs"] == direct.old_log_probs
    assert reply["usage"]["prompt_tokens"] == 4


def test_completion_text_leaves_special_tokens_out_as_vllm_does(front):
    eos = front.tokenizer.eos_token
    for seed in range(64):  # draws until one ends on EOS, which the text must not spell out
        status, reply = call(front, "/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 48, "seed": seed,
                                                         "logprobs": 0})
        choice = reply["choices"][0]
        if choice["finish_reason"] == "stop":
            break
    assert status == 200 and choice["finish_reason"] == "stop", "no draw of 64 seeds ended on EOS"
    ids = choice["dew"]["token_ids"]
    assert ids[-1] == front.tokenizer.eos_token_id and eos not in choice["text"]
    assert choice["text"] == front.tokenizer.decode(ids, skip_special_tokens=True)
    assert choice["logprobs"]["tokens"][-1] == eos  # a log-probability still names the token it scores


def test_chat_goes_through_the_template(front):
    status, reply = call(front, "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 5, "seed": 1})
    assert status == 200 and reply["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(reply["choices"][0]["message"]["content"], str)
    rendered = front.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}],
                                                   tokenize=False, add_generation_prompt=True)
    assert reply["usage"]["prompt_tokens"] == len(front.tokenizer.encode(rendered))


@pytest.mark.parametrize(
    "body, message",
    [({"prompt": [], "max_tokens": 4}, "prompt must be"), ({"prompt": [1, 10_000], "max_tokens": 4}, "outside the vocabulary"),
     ({"prompt": [1, 2], "max_tokens": 100}, "exceeds the cache capacity 64"),
     ({"prompt": [1, 2], "max_tokens": 4, "top_p": 1.5}, "top_p must be"),
     ({"prompt": [1, 2], "max_tokens": 4, "n": 0}, "n must be an integer from 1 to 64"),
     ({"prompt": [1, 2], "max_tokens": 4, "logprobs": 50}, "logprobs must be an integer from 0 to 20"),
     ({"prompt": [1, 2], "max_tokens": 4, "top_k": 5000}, "top_k=5000 exceeds the vocabulary"),
     ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens must be a positive integer")],
)
def test_bad_requests_get_400_and_the_server_keeps_serving(front, body, message):
    status, reply = call(front, "/v1/completions", body)
    assert status == 400 and message in reply["error"]["message"]
    assert call(front, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})[0] == 200


# ----- the front as a user of the official openai client meets it ----------------------------------------


@pytest.fixture(scope="module")
def client(front):
    from dew.inference import engine_client

    return engine_client(front.url)


def test_per_request_sampling_shares_a_batch_and_reports_each_requests_own_likelihood(front):
    import numpy as np

    server = front.rollout.server
    asks = [Sampling(temperature=0.5, eos_id=server.sampling.eos_id), Sampling(top_k=3, temperature=1.3),
            Sampling(top_p=0.8, min_p=0.05), None, Sampling(temperature=0.0)]
    prompt = [5, 6, 7, 8]
    futures = [front.rollout.submit(prompt, 6, seed=20 + i, sampling=ask) for i, ask in enumerate(asks)]
    draws = [f.result(timeout=60) for f in futures]
    from dew.sampling import filtered_logits

    for ask, draw in zip(asks, draws):
        ask = ask or server.sampling
        logits = server.model.apply(server.variables, jnp.asarray([prompt + draw.ids]))[0, len(prompt) - 1:-1]
        raw = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32)))
        np.testing.assert_allclose(draw.old_log_probs, [raw[i, t] for i, t in enumerate(draw.ids)], atol=2e-5)
        if ask.greedy:
            assert draw.ids == [int(i) for i in raw.argmax(-1)] and draw.behavior_log_probs == [0.0] * 6
            continue
        own = np.asarray(jax.nn.log_softmax(filtered_logits(logits, ask)[0], axis=-1))
        np.testing.assert_allclose(draw.behavior_log_probs, [own[i, t] for i, t in enumerate(draw.ids)], atol=2e-5)
    alone = front.rollout.submit(prompt, 6, seed=21, sampling=asks[1]).result(timeout=60)
    assert alone.ids == draws[1].ids  # a request draws the same alone or beside requests of other Samplings


def test_openai_client_completions_with_n_seed_logprobs_and_stop(client, front):
    reply = client.completions.create(model="dew", prompt=[5, 6, 7, 8], max_tokens=6, n=3, seed=4, temperature=0.9,
                                      top_p=0.95, logprobs=2, extra_body={"top_k": 10, "return_tokens_as_token_ids": True})
    assert [c.index for c in reply.choices] == [0, 1, 2] and reply.usage.completion_tokens == 18
    ids = [[int(t.removeprefix("token_id:")) for t in c.logprobs.tokens] for c in reply.choices]
    assert len({tuple(i) for i in ids}) > 1  # choice i draws with seed + i
    for choice in reply.choices:
        assert len(choice.logprobs.top_logprobs) == 6 and all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
        for token, value, top in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs,
                                     choice.logprobs.top_logprobs):
            assert value <= max(top.values()) + 1e-5  # the drawn token is never likelier than the likeliest
    again = client.completions.create(model="dew", prompt=[5, 6, 7, 8], max_tokens=6, seed=4, temperature=0.9,
                                      top_p=0.95, extra_body={"top_k": 10})
    assert again.choices[0].text == reply.choices[0].text
    text = reply.choices[0].text
    if len(text) > 2:
        cut = client.completions.create(model="dew", prompt=[5, 6, 7, 8], max_tokens=6, seed=4, temperature=0.9,
                                        top_p=0.95, stop=[text[1:3]], extra_body={"top_k": 10})
        assert cut.choices[0].text == text[:text.index(text[1:3])] and cut.choices[0].finish_reason == "stop"


def test_openai_client_streams_what_it_would_get_whole(client):
    whole = client.completions.create(model="dew", prompt="Once upon a time", max_tokens=8, seed=7, temperature=0.7)
    chunks = list(client.completions.create(model="dew", prompt="Once upon a time", max_tokens=8, seed=7,
                                            temperature=0.7, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason and len(chunks) == 8
    messages = [{"role": "user", "content": "Tell me a story."}]
    chat = client.chat.completions.create(model="dew", messages=messages, max_tokens=8, seed=3, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == len(chat.choices[0].model_extra["dew"]["token_ids"]) > 0
    assert all(1 <= len(entry.top_logprobs) <= 2 and entry.logprob <= 0 for entry in content)
    streamed = list(client.chat.completions.create(model="dew", messages=messages, max_tokens=8, seed=3, stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content
    assert streamed[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def test_a_model_that_is_not_served_gets_404(client):
    import openai

    with pytest.raises(openai.NotFoundError, match="The model `dew-stories` does not exist"):
        client.completions.create(model="dew-stories", prompt=[1, 2], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature must be"):
        client.completions.create(model="dew", prompt=[1, 2], max_tokens=2, temperature=-1)


def raw_post(front, head: str, body: bytes = b"") -> tuple[int, dict]:
    """A POST written by hand on a socket (headers as given), the write side closed after the body."""
    host, port = front.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + body)
        connection.shutdown(socket.SHUT_WR)
        reply = b"".join(iter(lambda: connection.recv(65536), b""))
    status_line, _, rest = reply.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def test_bodies_that_are_too_large_short_or_misdeclared_are_refused_by_name(front):
    status, reply = raw_post(front, f"Content-Length: {(16 << 20) + 1}\r\n")
    assert status == 413 and "this server takes at most 16777216" in reply["error"]["message"]
    status, reply = raw_post(front, "Content-Length: 100\r\n", b'{"prompt": [1]}')
    assert status == 400 and "the body ended after 15 of its 100 bytes" in reply["error"]["message"]
    status, reply = raw_post(front, "Content-Length: -5\r\n")
    assert status == 400 and "Content-Length must be a non-negative integer, got '-5'" in reply["error"]["message"]
    status, reply = raw_post(front, "Content-Length: 4\r\n", b"\xff\xfe{}")
    assert status == 400 and "the body is not JSON" in reply["error"]["message"]
    assert call(front, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})[0] == 200


def test_a_front_beyond_loopback_needs_an_api_key():
    from dew.inference.http import check_exposure

    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert check_exposure(host, (), False) == []
    for host in ("0.0.0.0", "10.0.0.12", "::", "node-3.cluster"):
        with pytest.raises(ValueError, match=f"listen on '{host}', beyond loopback, without an API key"):
            check_exposure(host, (), False)
        assert check_exposure(host, ["k"], False) == ["k"] and check_exposure(host, (), True) == []
    assert check_exposure("0.0.0.0", "one", False) == ["one"]
    with pytest.raises(ValueError, match="API keys must be non-empty strings"):
        check_exposure("127.0.0.1", [""], False)


def test_the_vllm_guard_asks_for_the_key_on_every_route_but_health(monkeypatch):
    """The middleware dew loads into the vLLM engines it launches beyond loopback (vLLM's own key guards /v1 only),
    called as vLLM's ASGI server calls it; the live engines' refusals are in the vLLM pipeline test."""
    import asyncio
    import importlib.util

    from dew.inference.engines import GUARDED, VLLMEngine

    spec = importlib.util.spec_from_file_location("dew_vllm_guard", GUARDED / "dew_vllm_guard.py")
    guard = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guard)
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    def status(path: str, authorization: str | None) -> int:
        sent = []

        async def send(message):
            sent.append(message)

        headers = [(b"authorization", authorization.encode())] if authorization else []
        scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"host", b"x"), *headers]}
        asyncio.run(guarded(scope, None, send))
        return sent[0]["status"]

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="needs VLLM_API_KEY"):
        guard.EveryRoute(app)
    monkeypatch.setenv("VLLM_API_KEY", "the-key")
    guarded = guard.EveryRoute(app)
    for path in ("/pause", "/collective_rpc", "/update_weights", "/v1/completions", "/metrics", "/"):
        for authorization in (None, "Bearer other", "Basic the-key", "the-key"):
            assert status(path, authorization) == 401, (path, authorization)
        assert status(path, "Bearer the-key") == 200 and reached[-1] == path
    assert status("/health", None) == 200
    assert reached.count("/pause") == 1  # nothing refused reached the engine

    # an engine beyond loopback is refused without a key before anything starts
    with pytest.raises(ValueError, match="beyond loopback, with its development routes"):
        VLLMEngine("/nonexistent", host="10.0.0.12")


def test_an_engine_guard_killed_outright_still_takes_its_whole_group_down():
    """Ray SIGKILLs an actor's direct children when the actor dies: the engine's guard itself, which then cannot act.
    Its warden (forked into the group) is told and kills the group, here a program that ignores SIGTERM as vLLM's
    server does when its graceful shutdown waits on a request its engine core will never finish."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import import_from
    from dew.inference.engines import GUARD

    processes = import_from("bench", "processes")
    actor = subprocess.Popen([sys.executable, "-c", GUARD, str(os.getpid()), "sh", "-c", "trap '' TERM; sleep 600"],
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(processes.group_processes(actor.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(processes.group_processes(actor.pid)) >= 3  # the guard, its warden, the program (and its sleep)
        os.kill(actor.pid, signal.SIGKILL)
        actor.wait(10)
        deadline = time.monotonic() + 10
        while processes.group_processes(actor.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not processes.group_processes(actor.pid), processes.group_processes(actor.pid)
    finally:
        try:
            os.killpg(actor.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
