"""The RLVR pipeline's options: the built-in run's (:class:`dew.recipes.rlvr_recipe.RLVRConfig`) plus the Ray roles.

Read with :func:`load_config` (a TOML file, flat or under ``[rlvr]``, then ``--set
key=value`` overrides), the loader every pipeline shares (:mod:`dew.config`); a bad value
raises naming the field, the value and what was expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from dew.config import load_config as load_any
from dew.experiment_trackers import TrackerOptions
from dew.recipes.judge_reward import JUDGE_TEMPLATE, check_template
from dew.recipes.rlvr_recipe import RLVRConfig
from dew_ray.placement import Role


Strategy = Literal["pack", "spread"]
NodeResources = dict[str, Annotated[float, Field(gt=0)]]


class RLVRPipelineConfig(RLVRConfig, TrackerOptions):
    """Options of one pipeline run: the built-in run's, and

    model: a Hugging Face model directory to train (Llama, Qwen2 or Qwen3, as
    :class:`~dew.models.pretrained.Pretrained` reads it; None: the built-in decoder,
    warm-started on the built-in demonstrations); tokenizer: its tokenizer directory (default:
    the model's); dtype: what the trainer computes in ("bfloat16": bfloat16 products over
    float32 master weights); warm_start: an SFT file of chat conversations (a ``messages``
    column, ChatMessages' layout) the model is first fitted to for ``sft_steps`` (None: a
    user's model starts as it is); prompts, val_prompts: verl-layout prompts (Parquet, JSON
    lines, or a directory ``datasets`` saved with ``save_to_disk``) to train on and to
    measure on (every val_prompts row is measured, ``eval_samples`` draws each; None: the
    built-in tasks and held-out split, and prompts without val_prompts measures on the first
    ``eval_tasks`` prompt rows); message prompts render through the
    tokenizer's chat template with the generation prompt, ``enable_thinking`` passed to
    templates that read it; enable_thinking: the chat template's thinking switch (Qwen3's; None
    leaves the template's default); max_prompt_length: prompts longer than this many ids are left out
    and counted (verl's ``filter_overlong_prompts``; None keeps every prompt, the row width
    following the longest); reward: "verifiable" (routes by ``data_source``: the built-in
    families, ``openai/gsm8k`` by verl's GSM8K rule, competition math by MathReward; a source no
    route scores is refused before any actor starts), "judge" (a model judge scores each
    response: :mod:`dew.recipes.judge_reward` and the judge_* fields) or a function of dew's
    reward signature, "module:function" or "path/to/file.py:function" (a relative path, or a
    module in the working directory, resolves against the driver's working directory);
    judge_model: the judge's Hugging Face directory (Llama, Qwen2 or Qwen3), served greedily by
    ``judge_servers`` RolloutServerActors of its own (``judge_cpus`` Ray CPUs each, never
    pushed to); judge_template: the judge's prompt, with ``{response}`` and any of
    ``{prompt}`` (the policy's prompt, decoded), ``{ground_truth}``, ``{data_source}``,
    ``{extra_info}``; judge_chat_template: send it as one user message through the judge's
    chat template with the generation prompt (false: as plain text); judge_parser: "first_number" (the first number
    of the reply) or "module:function" / "file.py:function" from the reply's text to a float;
    judge_max_new_tokens: the reply's budget; judge_max_length: the longest judge prompt plus
    reply. A reply that does not parse, or a judge prompt past judge_max_length, makes that
    response an infrastructure error (drawn again), never a zero reward;
    judge_servers, judge_cpus: the judge's RolloutServerActors and the Ray CPUs each reserves;
    environment: run every prompt as a multi-turn tool episode (None: single-turn draws):
    "calculator" (the built-in one, :mod:`dew.recipes.calculator_environment`: the policy calls
    ``calc(EXPRESSION)``, reads the result, then answers, scored by ``reward``) or a factory of
    the user's, "module:factory" or "path/to/file.py:factory"
    (:mod:`dew.recipes.run_environment`); its sessions' model calls go to the rollout servers
    (engine="native"); environment_workers, environment_cpus: the EnvironmentWorker actors
    that run the sessions and the Ray CPUs each reserves; max_turns: model calls per episode (a call past it
    truncates the episode); max_context_tokens: the longest context a model call may read
    (prompt, earlier responses and tool results; a longer one truncates the episode, unscored;
    None: the longest prompt + (max_turns - 1) x 2 x max_new_tokens); each call draws at most
    ``max_new_tokens``. metrics.jsonl adds ``rollout/episode/turns``, ``turns_max``,
    ``truncated``, and the environment's own (the calculator's ``tool_calls`` and
    ``tool_errors``); the held-out measure runs the same episodes;

    run_dir: the run directory (relative paths resolve against the driver's working
    directory on a local cluster; a submitted job needs an absolute path every node
    reaches); trainers, servers, sandbox_runners: actors of each role; trainer_cpus,
    server_cpus, sandbox_cpus: Ray CPUs reserved per actor; prompts: a verl-style
    Parquet/JSONL file instead of the built-in tasks; checkpoint_every: updates between
    checkpoints. ``sandbox_workers`` is per runner and ``slots`` per server. engine:
    "native" (dew's RolloutServerActors, weights through the object store) or "vllm"
    (``servers`` vLLM engines owned by VLLMEngineActors, from the engine environment, drawn
    from through OpenAIRolloutServer and published by SafetensorsReload into
    ``<run_dir>/engine/policy``, a path every engine's node must read); engine_python: the
    python of an environment with vLLM installed, on every engine node (None: the one
    ``tools/engine_env.py`` builds, its CUDA build ``vllm-cuda`` on a node with GPUs where built,
    else the CPU build ``vllm``); engine_dtype: what the rollout servers compute in, vLLM's ``--dtype``, and for a native
    server "bfloat16" holds bfloat16 weights and runs its weight products on bfloat16 operands with norms, rotary,
    attention and sampling in float32 (about twice as fast on CPUs with AVX512-BF16 or AMX); server_gpus: GPUs in each rollout server's bundle (the vLLM engine
    inherits the actor's CUDA_VISIBLE_DEVICES). engine_push: how the trainer publishes to
    the engines, "reload" (SafetensorsReload through that directory) or "nccl" (NCCLPush:
    a broadcast from the trainer's GPU, so trainer_gpus and server_gpus must be set, and the
    engines launch with the NCCL weight-transfer backend); nccl_library: the engines'
    ``libnccl.so.2`` on the trainer's node (default: the engine environment's
    ``nvidia/nccl/lib/libnccl.so.2``); trainer_gpus: GPUs in each trainer's bundle.
    verl_rows: also write every update's admitted rollouts, all processes', as verl
    AgentLoopOutput rows (``dew.objectives.rl.verl.to_verl``, one JSON row per line) in
    ``<run_dir>/verl_rows/update-<step>.jsonl``, beside ``metrics.jsonl``. record: write the
    batch every update trained on, the trainer's own (:mod:`dew.update_record`), in
    ``<run_dir>/record/``, so that ``dew-ray replay RUN_DIR`` trains the run again bit for bit
    without servers, sandboxes or engines (a run of one trainer process). eval_points: how
    many times during training the held-out reward is measured besides before and after
    (evenly spaced updates; ``held_out.jsonl`` and the plot), 0 for before and after only.
    server_timeout: seconds a rollout server (native, or a vLLM engine) may answer nothing while
    draws or a weight load wait on it before the pools set it aside (its draws are drawn again
    on the others; it rejoins once it answers and serves the current weights:
    :class:`~dew_ray.actors.ServerPool`, :class:`~dew.inference.EnginePool`).
    restarts: how many times Ray brings back a lost rollout server, sandbox runner, environment
    worker or judge server (its process or its node lost; -1: without limit): the actor starts
    again in its placement-group bundle on a node with room, a rollout server loads the current
    weights before it takes draws, and the survivors take the work meanwhile (an engine="vllm"
    engine comes back with its actor, at a new address the pools follow, or, when only its
    process exited, from its actor; a program a lost sandbox runner was running runs again on another, at most
    ``max_attempts - 1`` times); a lost trainer makes the driver start every actor of the run
    again from the newest checkpoint, at most ``restarts`` times; trainer_strategy, server_strategy, sandbox_strategy,
    environment_strategy, judge_strategy: how each role's actors are placed over the nodes,
    "pack" (as few nodes as fit) or "spread" (as many as there are: a lost node takes as few of
    the role's actors as it can); trainer_resources, server_resources, sandbox_resources,
    environment_resources, judge_resources: node resources each actor of the role asks for, such
    as ``{"rollout": 1}`` for nodes started with ``ray start --resources='{"rollout": 4}'`` (the
    role runs only on nodes that offer them). The driver prints the node of every actor, and
    summary.json lists them under ``placement``.
    servers_min, servers_max: the rollout fleet's bounds during the run (None: ``servers``);
    with servers_max above servers the fleet grows by one server before an update whenever the
    cluster has room for it (a node joined), and ``RLVRPipeline.add_servers(n)`` /
    ``remove_servers(n)`` change it within the bounds; an added server loads the newest weights
    before it draws, a removed one's draws finish or are drawn again on the others
    (:mod:`dew_ray.pipelines.rlvr_fleet`; ``fleet.jsonl``, ``fleet/servers`` in metrics.jsonl;
    engine="native" only).
    trackers, wandb_project, wandb_mode: experiment trackers that get every ``metrics.jsonl``
    row from the driver (:class:`dew.experiment_trackers.TrackerOptions`): TensorBoard event
    files in ``<run_dir>/tensorboard``, a W&B run in ``<run_dir>/wandb``.
    """

    synonyms = {**RLVRConfig.synonyms, "train_files": "prompts", "val_files": "val_prompts", "path": "model",
                "model_path": "model", "reward_function": "reward"}  # verl's names

    run_dir: str = "runs/rlvr"
    trainers: int = Field(1, ge=1)
    servers: int = Field(1, ge=1)
    servers_min: int | None = Field(None, ge=1)
    servers_max: int | None = Field(None, ge=1)
    sandbox_runners: int = Field(1, ge=1)
    trainer_cpus: float = Field(1.0, gt=0)
    server_cpus: float = Field(1.0, gt=0)
    sandbox_cpus: float = Field(0.25, gt=0)
    model: str | None = None
    tokenizer: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    warm_start: str | None = None
    prompts: str | None = None
    val_prompts: str | None = None
    enable_thinking: bool | None = None
    max_prompt_length: int | None = Field(None, ge=1)
    reward: str = "verifiable"
    judge_model: str | None = None
    judge_template: str = JUDGE_TEMPLATE
    judge_parser: str = "first_number"
    judge_servers: int = Field(1, ge=1)
    judge_cpus: float = Field(1.0, gt=0)
    judge_max_new_tokens: int = Field(16, ge=1)
    judge_max_length: int = Field(1024, ge=2)
    judge_chat_template: bool = True
    environment: str | None = None
    environment_workers: int = Field(1, ge=1)
    environment_cpus: float = Field(0.5, gt=0)
    max_turns: int = Field(2, ge=1)
    max_context_tokens: int | None = Field(None, ge=1)
    checkpoint_every: int = Field(5, ge=1)
    engine: Literal["native", "vllm"] = "native"
    engine_python: str | None = None
    engine_dtype: Literal["float32", "bfloat16"] = "float32"
    server_gpus: float = Field(0.0, ge=0)
    engine_push: Literal["reload", "nccl"] = "reload"
    nccl_library: str | None = None
    trainer_gpus: float = Field(0.0, ge=0)
    verl_rows: bool = False
    record: bool = True
    eval_points: int = Field(3, ge=0)
    server_timeout: float = Field(60.0, gt=0)
    restarts: int = Field(3, ge=-1)
    trainer_strategy: Strategy = "pack"
    server_strategy: Strategy = "pack"
    sandbox_strategy: Strategy = "pack"
    environment_strategy: Strategy = "pack"
    judge_strategy: Strategy = "pack"
    trainer_resources: NodeResources = {}
    server_resources: NodeResources = {}
    sandbox_resources: NodeResources = {}
    environment_resources: NodeResources = {}
    judge_resources: NodeResources = {}

    @model_validator(mode="after")
    def _roles(self):
        low, high = self.fleet_bounds()
        if not low <= self.servers <= high:
            raise ValueError(f"config fields 'servers_min' ({low}), 'servers' ({self.servers}) and 'servers_max' "
                             f"({high}) must be in order: the fleet starts at 'servers' and stays between the bounds")
        if high > self.servers and self.engine != "native":
            raise ValueError(f"config field 'servers_max' ({high}) above 'servers' ({self.servers}) needs "
                             f"engine='native': a fleet of {self.engine} engines is fixed for the run")
        if self.tasks_per_step % self.trainers:
            raise ValueError(f"config field 'tasks_per_step' ({self.tasks_per_step}) must divide evenly over "
                             f"trainers={self.trainers}: each trainer process trains on its own share of the tasks")
        for field in ("prompts", "val_prompts", "warm_start"):
            value = getattr(self, field)
            if value is not None and not Path(value).expanduser().exists():
                raise ValueError(f"config field {field!r} names {value!r}, which is not a file or directory")
        if self.model is not None and not Path(self.model).expanduser().is_dir():
            raise ValueError(f"config field 'model' names {self.model!r}, which is not a directory (a Hugging Face "
                             "model directory: config.json, safetensors, tokenizer files)")
        if self.tokenizer is not None and self.model is None:
            raise ValueError("config field 'tokenizer' needs 'model': the built-in decoder has its own tokenizer")
        if self.reward not in ("verifiable", "judge") and ":" not in self.reward:
            raise ValueError(f"config field 'reward' must be \"verifiable\", \"judge\", \"module:function\" or "
                             f"\"path/to/file.py:function\", got {self.reward!r}")
        if (self.reward == "judge") != (self.judge_model is not None):
            raise ValueError("config field 'reward' = \"judge\" needs 'judge_model' (the judge's Hugging Face "
                             "directory), and 'judge_model' needs reward = \"judge\"")
        if self.judge_model is not None and not Path(self.judge_model).expanduser().is_dir():
            raise ValueError(f"config field 'judge_model' names {self.judge_model!r}, which is not a directory")
        check_template(self.judge_template)
        if self.environment is not None and self.engine != "native":
            raise ValueError("config field 'environment' needs engine='native': environment workers send their model "
                             "calls to the native rollout servers (vLLM engines serve single-turn runs here)")
        if self.environment is None and (self.max_context_tokens is not None
                                         or self.max_turns != type(self).model_fields["max_turns"].default):
            raise ValueError("config fields 'max_turns' and 'max_context_tokens' need 'environment': a run without "
                             "one draws a single response per prompt")
        if self.deterministic and self.engine != "native":
            raise ValueError("config field 'deterministic' needs engine='native': vLLM's batch-invariant mode "
                             "(VLLM_BATCH_INVARIANT) runs on GPUs only, and this run's engines are not started with it")
        if self.engine_python is not None and self.engine != "vllm":
            raise ValueError("config field 'engine_python' needs engine='vllm'")
        if self.server_gpus and self.engine != "vllm":
            raise ValueError("config field 'server_gpus' needs engine='vllm': the native servers run on CPU here")
        if self.engine_push == "nccl" and (self.engine != "vllm" or not self.server_gpus or not self.trainer_gpus):
            raise ValueError("config field 'engine_push' = 'nccl' needs engine='vllm' and GPUs on both sides "
                             f"(server_gpus={self.server_gpus:g}, trainer_gpus={self.trainer_gpus:g}): an NCCL "
                             "broadcast runs from a trainer GPU into the engines' GPUs")
        return self

    def fleet_bounds(self) -> tuple[int, int]:
        """The least and most rollout servers a run may have while it trains (add_servers, remove_servers)."""
        return (self.servers_min or self.servers, self.servers_max or self.servers)

    def eval_steps(self) -> list[int]:
        """The updates after which the held-out reward is measured during training (``eval_points`` of them)."""
        return sorted({round(self.steps * i / (self.eval_points + 1)) for i in range(1, self.eval_points + 1)}
                      - {0, self.steps})

    def roles(self) -> dict[str, Role]:
        """Every role this run starts, with its actors' count, reservations and placement."""
        roles = {"trainer": Role(self.trainers, self.trainer_cpus, self.trainer_gpus, self.trainer_strategy,
                                 self.trainer_resources),
                 "rollout server": Role(self.servers, self.server_cpus, self.server_gpus, self.server_strategy,
                                        self.server_resources),
                 "sandbox runner": Role(self.sandbox_runners, self.sandbox_cpus, 0.0, self.sandbox_strategy,
                                        self.sandbox_resources)}
        if self.environment is not None:
            roles["environment worker"] = Role(self.environment_workers, self.environment_cpus, 0.0,
                                               self.environment_strategy, self.environment_resources)
        if self.reward == "judge":
            roles["judge server"] = Role(self.judge_servers, self.judge_cpus, 0.0, self.judge_strategy,
                                         self.judge_resources)
        return roles

    def cpu_demand(self) -> dict[str, float]:
        """Ray CPUs each role reserves at once (the warm start runs before the trainers, on their share)."""
        demand = {"trainers": self.trainers * self.trainer_cpus, "rollout servers": self.servers * self.server_cpus,
                  "sandbox runners": self.sandbox_runners * self.sandbox_cpus}
        if self.reward == "judge":
            demand["judge servers"] = self.judge_servers * self.judge_cpus
        if self.environment is not None:
            demand["environment workers"] = self.environment_workers * self.environment_cpus
        return demand


def load_config(path: str | Path | None = None, overrides=(), **values) -> RLVRPipelineConfig:
    """A pipeline config from a TOML file (flat keys, or under ``[rlvr]``), then ``key=value`` overrides, then values."""
    return load_any(RLVRPipelineConfig, path, overrides, table="rlvr", **values)
