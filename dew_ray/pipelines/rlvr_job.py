"""What the RLVR pipeline runs inside its actors: the warm-start task and each trainer process's GRPO job.

The driver works out a :class:`Setup` once (config, row width, prompt length, prompt rows,
the model and its tokenizer) and the warm-start task and every trainer process build their
work from it (:func:`trainer_job`), the same GRPO job
the one-process example trains (:func:`dew.recipes.rlvr_recipe.grpo_job`), here over a
:class:`~dew_ray.actors.ServerPool` of the rollout-server actors (or, with ``engine="vllm"``,
an EnginePool over the vLLM engines, :func:`engine_rollouts`), scored by the built-in
rewards with code on the sandbox-runner actors (:class:`~dew_ray.actors.RemoteFleet`), by
a model judge on the judge-server actors (:func:`judge_pool`), or by the user's reward function. What the setup holds (the policy, its tokenizer, the prompt rows
and the row width) comes from :func:`dew.recipes.rlvr_plan.plan_run`: the built-in tasks and
decoder, or the user's model and prompts.
With an ``environment`` each trainer's source is a
:class:`~dew_ray.actors.RemoteEnvironmentSource` over the run's EnvironmentWorker actors,
which build the environment in their own processes (:class:`PipelineEnvironment`).
With ``verl_rows`` each process's report carries its admitted rollouts as verl
AgentLoopOutput rows (:func:`dew.records.verl_rows.to_verl`), every call of a session.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import serialization

from dew.data import Loading
from dew.inference.engines import engine_dir, vllm_python
from dew.recipes.reward_routing import verifiable_reward
from dew.recipes.rlvr_recipe import grpo_job, rollout_sampling, warm_start
from dew.models.pretrained import Pretrained
from dew.records.verl_rows import to_verl
from dew.sampling import Sampling
from dew.recipes.judge_reward import JudgeReward
from dew.recipes.run_environment import EnvironmentSetup, build_environment
from dew_ray.actors import RemoteEnvironmentSource, RemoteFleet, ServerPool, TrainJob, server_pool, vllm_rollouts
from dew_ray.pipelines.rlvr_config import RLVRPipelineConfig


@dataclasses.dataclass
class Setup:
    """What the driver works out once and every trainer process rebuilds its job from."""

    config: RLVRPipelineConfig
    run_dir: str  # absolute: every actor writes where the driver resolved it
    width: int
    prompt_len: int
    rows: list[dict]
    model: object  # the flax module every process trains or serves (built once, pickled to the actors)
    tokenizer: object
    pretrained: Pretrained  # the model's Hugging Face form: exports and the vLLM engines' files
    eos_ids: tuple[int, ...]
    reward: object = "verifiable"  # or the user's FunctionReference
    template_options: dict = dataclasses.field(default_factory=dict)
    engines: list[str] | None = None  # engine="vllm": the engines' URLs, serving engine_policy(run_dir)
    engine_key: str | None = None  # their API key (one per start of the run's actors; it travels inside Ray only)
    engine_hosts: list | None = None  # their VLLMEngineActors, one per URL: asked where an engine that came back is
    environment: object = None  # the environment factory (config environment); None: single-turn draws
    context_tokens: int | None = None  # with an environment, the longest context a model call reads
    demonstrations: object = None  # how the built-in warm start writes a task's demonstration (None: the plain one)
    judge_tokenizer: object = None  # reward="judge": the judge's tokenizer, EOS ids and reply parser
    judge_eos_ids: tuple[int, ...] = ()
    judge_parse: object = None
    judges: list | None = None  # reward="judge": (name, RolloutServerActor) of the judge servers, once started

    def sampling(self) -> Sampling:
        return rollout_sampling(self.config, self.eos_ids)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def episode_options(self) -> dict:
        """EnvironmentSource's limits for this run's episodes."""
        return {"max_prompt_tokens": self.context_tokens, "max_new_tokens": self.config.max_new_tokens,
                "max_turns": self.config.max_turns, "eos_ids": self.eos_ids}


@dataclasses.dataclass
class PipelineEnvironment:
    """The run's environment and verifier as each process that runs sessions builds them (``build``).

    It pickles as the setup and the sandbox-runner handles; ``build`` makes the run's reward
    there (the verifiable routes with code on a RemoteFleet over ``runners``, or the user's
    function) and calls the factory (:func:`dew.recipes.run_environment.build_environment`).
    """

    setup: Setup
    runners: list

    def build(self, fleet=None, judges=None) -> tuple:
        """(environment, verifier); ``fleet``, ``judges``: the process's own sandbox fleet and judge pool (default:
        ones over ``runners`` and the setup's judge servers)."""
        setup = self.setup
        fleet = fleet or sandbox_fleet(self.runners, setup.config)
        reward = pipeline_reward(setup, fleet, judges or judge_pool(setup))
        return build_environment(setup.environment, EnvironmentSetup(setup.tokenizer, reward, setup.eos_ids,
                                                                     setup.config.max_turns))

    def __call__(self) -> tuple:
        return self.build()


ENGINE_MODEL = "dew-rlvr"  # the name the run's vLLM engines serve the policy under
BUNDLED_NCCL = "lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2"  # in a pip-installed CUDA vLLM


def engine_policy(run_dir) -> str:
    """Where SafetensorsReload publishes the policy the vLLM engines serve (they launch on it)."""
    return str(Path(run_dir) / "engine" / "policy")


def engine_args(config) -> list[str]:
    """The run's vLLM flags: processed log-probabilities, and the NCCL weight-transfer backend for engine_push='nccl'."""
    args = ["--logprobs-mode", "processed_logprobs"]
    return args + (["--weight-transfer-config", '{"backend": "nccl"}'] if config.engine_push == "nccl" else [])


def engine_rollouts(setup: Setup, version: int, push: str = "reload"):
    """The EnginePool over the run's vLLM engines, publishing into engine_policy(run_dir) or by NCCL broadcast."""
    config = setup.config
    # the engines' environment: the user's, else the one the engines launch from (vllm_python picks it)
    python = config.engine_python or vllm_python()
    root = Path(python).expanduser().parent.parent if python else engine_dir("vllm")
    library = config.nccl_library or str(next(root.glob(BUNDLED_NCCL), root / BUNDLED_NCCL))
    return vllm_rollouts(setup.pretrained, engine_policy(setup.run_dir), setup.engines, setup.sampling(),
                         name=ENGINE_MODEL, version=version, served_dtype=config.engine_dtype,
                         nccl_library=library if push == "nccl" else None, timeout=config.server_timeout,
                         api_key=setup.engine_key, hosts=setup.engine_hosts)


def sandbox_fleet(runners: list, config: RLVRPipelineConfig) -> RemoteFleet:
    """The run's sandbox runners as one fleet for this process. A program whose runner died (its process or its
    node lost) runs again on another up to ``max_attempts - 1`` times, as a draw whose server died is drawn again:
    past that its reward raises, and a held-out measurement's takes the run down with it."""
    return RemoteFleet(runners, workers=config.sandbox_workers, retries=config.max_attempts - 1)


def judge_pool(setup: Setup) -> ServerPool | None:
    """A pool over the run's judge servers for this process (None without a judge)."""
    if not setup.judges:
        return None
    return server_pool(setup.judges, timeout=setup.config.server_timeout)


def pipeline_reward(setup: Setup, fleet, judges: ServerPool | None = None):
    """The run's reward: the verifiable routes (code on ``fleet``), the judge on ``judges``, or the user's function."""
    config = setup.config
    if setup.reward == "verifiable":
        return verifiable_reward(fleet)
    if setup.reward == "judge":
        return JudgeReward(judges, setup.judge_tokenizer, config.judge_template, setup.judge_parse,
                           max_new_tokens=config.judge_max_new_tokens, max_length=config.judge_max_length,
                           eos_ids=setup.judge_eos_ids, chat=config.judge_chat_template)
    return setup.reward


class CountingFleet:
    """A fleet that tallies the verdicts of the programs it ran (for the dashboard)."""

    def __init__(self, fleet):
        self.fleet = fleet
        self.verdicts: dict[str, int] = {}

    def map(self, programs):
        outcomes = self.fleet.map(programs)
        for outcome in outcomes:
            self.verdicts[outcome.verdict.name] = self.verdicts.get(outcome.verdict.name, 0) + 1
        return outcomes

    def drain(self) -> dict[str, int]:
        counts, self.verdicts = self.verdicts, {}
        return counts


def trainer_job(setup: Setup, params, servers: list, runners: list, environment_workers: list = ()) -> TrainJob:
    """The GRPO job of one trainer process (runs inside a TrainerActor); with an environment its sessions run on
    ``environment_workers`` (a RemoteEnvironmentSource)."""
    config, tokenizer = setup.config, setup.tokenizer
    if setup.engines:
        pool = engine_rollouts(setup, version=-1, push=config.engine_push)
    else:
        pool = server_pool(servers, timeout=config.server_timeout)
    fleet = CountingFleet(sandbox_fleet(runners, config))
    judges = judge_pool(setup)
    # The trainer's own bar stays off: the driver shows the run's. (The config is not rebuilt here: its checks,
    # the prompts file's existence among them, hold on the driver's machine, not necessarily on this node.)
    job = grpo_job(config, setup.model, params, tokenizer, setup.rows, setup.prompt_len, pool,
                   pipeline_reward(setup, fleet, judges), loading=Loading(seed=config.seed),
                   eos_ids=setup.eos_ids, template_options=setup.template_options,
                   score_workers=max(2, config.sandbox_workers * len(runners)), progress=False,
                   output_dir=str(Path(setup.run_dir) / "grpo"),
                   push="each" if setup.engines else "one",  # every process calls a SafetensorsReload
                   source=RemoteEnvironmentSource(environment_workers) if setup.environment else None,
                   width=setup.width, record=str(Path(setup.run_dir) / "record") if config.record else None)

    def report() -> dict:
        out = {"verdicts": fleet.drain(), "tasks": job.tasks[-1] if job.tasks else []}
        if job.records:
            record = job.records[-1]
            if config.verl_rows:  # this process's admitted rollouts, for the driver to write beside metrics.jsonl
                out["verl_rows"] = to_verl(record.sessions)
            out["scheduler"] = {
                "version": record.version, "oldest_version": record.oldest_version, "lag": record.lag,
                "admitted_groups": record.admitted_groups, "resubmissions": record.resubmissions,
                "cancellations": record.cancellations, "abandoned_groups": record.abandoned_groups,
                "cut_groups": record.cut_groups, "waited": record.waited, "pushed": record.pushed,
                "push_seconds": record.push_seconds,
                **{f"rollout/{k}": v for k, v in record.metrics.items()},
            }
        job.records.clear()
        return out

    def close():
        job.close()
        pool.close()
        if judges is not None:
            judges.close()

    return TrainJob(job.trainer, job.data, close=close, report=report, servers=None if setup.engines else pool)


def start_params(config: RLVRPipelineConfig, plan, run_dir: Path):
    """The weights GRPO starts from, when they need no training now: a user's model as loaded (no warm_start
    conversations), else the warm start ``run_dir/warm_start.msgpack`` read back; None when the warm start has yet
    to run."""
    if plan.policy.params is not None and config.warm_start is None:
        return plan.policy.params
    path = Path(run_dir) / "warm_start.msgpack"
    if not path.exists():
        return None
    template = jax.eval_shape(plan.policy.model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    return serialization.from_bytes(template, path.read_bytes())


def warm_start_task(setup: Setup, train, start=None):
    """The SFT warm start, run as a Ray task on the trainer's share of the CPUs before the trainers start:
    the built-in demonstrations of ``train`` or the config's ``warm_start`` conversations, from ``start``
    (a user's model) or the decoder's initialisation."""
    config = setup.config
    return warm_start(setup.model, setup.tokenizer, train or [], setup.width, config.sft_steps, config.sft_batch,
                      config.sft_learning_rate, key=jax.random.fold_in(jax.random.key(config.seed), 1),
                      seed=config.seed, progress=False, errors=config.sft_errors, pretrained=start,
                      conversations=config.warm_start, **({"documents": setup.demonstrations}
                                                          if setup.demonstrations else {}))
