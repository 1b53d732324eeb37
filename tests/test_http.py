import json
import urllib.error
import urllib.request

import jax
import jax.numpy as jnp
import pytest

from dew.data.stories import story_decoder, story_tokenizer
from dew.inference import NativeRolloutServer, OpenAIFront, Server
from dew.sampling import Sampling


@pytest.fixture(scope="module")
def front():
    tokenizer = story_tokenizer()
    model = story_decoder(len(tokenizer), max_seq_len=64)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    sampling = Sampling(temperature=1.0, top_k=20, eos_id=tokenizer.eos_token_id)
    rollout = NativeRolloutServer(Server(model, variables, sampling, slots=4, capacity=64))
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
     ({"prompt": [1, 2], "max_tokens": 4, "temperature": 0.5}, "temperature=0.5 differs from the served sampling"),
     ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens must be a positive integer")],
)
def test_bad_requests_get_400_and_the_server_keeps_serving(front, body, message):
    status, reply = call(front, "/v1/completions", body)
    assert status == 400 and message in reply["error"]["message"]
    assert call(front, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})[0] == 200
