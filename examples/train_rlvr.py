"""Asynchronous RLVR on the built-in verifiable tasks: SFT warm start, then GRPO through RolloutScheduler.

    uv run python examples/train_rlvr.py [--steps 120] [--seed 0] [--max-lag 1] [--ahead 1] [--output-dir DIR]

What it does, all in this process on CPU:

1. builds the built-in tasks of :mod:`dew.data.verifiable` (arithmetic checked by
   MathReward, one-line programs run by CodeReward in a SandboxFleet), their
   character-level tokenizer and a tiny decoder (:mod:`dew.models`, 0.34M parameters);
2. warm-starts the decoder with a short SFT on the tasks' demonstrations
   (LMObjective on the answers only), written by a fallible teacher with one habit:
   ``sft_errors`` of them write a number one higher than the right one
   (:func:`~dew.data.verifiable.teacher_errors`), so the warm start learns the rule and
   the habit with it;
3. measures the mean reward on the held-out split, tasks whose prompts never occur in
   training (see :mod:`dew.data.verifiable`), sampling at temperature 1 through the
   rollout server with fixed seeds;
4. trains GRPO (:class:`~dew.objectives.rl.GRPOObjective`) with a
   :class:`~dew.collection.scheduler.RolloutScheduler` over a
   :class:`~dew.objectives.rl.PromptSource` on a
   :class:`~dew.inference.NativeRolloutServer`, ``truncation="score"``: each batch's
   rollouts run on the server's thread while the trainer updates on the batch before,
   ``ahead`` batches ahead, each at most ``max_lag`` updates stale;
5. measures the evaluation reward again with the same seeds, and reports the share of
   the trainer's wall time after its first update spent waiting for rollouts.

``run(RLVRConfig(...)) -> RLVRResult`` is the importable core (bench/rlvr_async.py and
tests/test_train_rlvr.py use it). Programs run in bubblewrap (``runner="bwrap"``, the
default); ``runner="process"`` uses ProcessRunner, which isolates nothing and is only
for trusted completions.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dew.collection.scheduler import SchedulerRecord
from dew.data import Loading
from dew.data.verifiable import VerifiableTask, shared_prompts, task_rows, task_tokenizer
from dew.inference import NativeRolloutServer, Server
from dew.recipes import rlvr_recipe
from dew.recipes.reward_routing import verifiable_reward
from dew.recipes.rlvr_recipe import (
    RUNNERS,
    SANDBOX_LIMITS,
    built_in_tasks,
    decoder,
    grpo_job,
    measure_reward,
    rollout_sampling,
    sandbox_runner,
)
from dew.sandbox import SandboxFleet


class RLVRConfig(rlvr_recipe.RLVRConfig):
    """The built-in run's options (:class:`dew.recipes.rlvr_recipe.RLVRConfig`) and where this run writes.

    output_dir: where metrics, checkpoints and result.json go (None: nowhere).
    """

    output_dir: str | None = None


@dataclasses.dataclass
class RLVRResult:
    """What a run measured.

    reward_before, reward_after: mean evaluation reward after SFT and after GRPO (same
    tasks, same sampling seeds); family_before, family_after: the same per family;
    wait_share: seconds the trainer waited for rollouts after its first update over
    the wall time from then to the end of GRPO; waited, rl_after_first_seconds: those two
    numbers; records: the scheduler's record of every call; train_rewards: the mean
    reward of each batch trained on; trained_sessions: how many rollouts each update
    trained on (admitted groups times samples when every group is whole); lag_shares: each
    trained batch's share of sampled ids 0, 1, and 2 or more updates behind the weights it
    trained (``GRPOJob.lag_shares``); seconds: wall
    time by phase ("sft", 0 when given a warm start, "eval_before", "grpo",
    "eval_after", "total"); parameters: the decoder's size; shared_prompts: how many
    evaluation prompts also occur among the training tasks.
    """

    config: RLVRConfig
    reward_before: float
    reward_after: float
    family_before: dict[str, float]
    family_after: dict[str, float]
    wait_share: float
    waited: float
    rl_after_first_seconds: float
    records: list[SchedulerRecord]
    train_rewards: list[float]
    trained_sessions: list[int]
    lag_shares: list[dict[str, float]]
    seconds: dict[str, float]
    parameters: int
    shared_prompts: int

    def summary(self) -> dict:
        """The result as JSON-ready values (records reduced to their main numbers)."""
        return {
            "config": self.config.model_dump(),
            "reward_before": self.reward_before, "reward_after": self.reward_after,
            "family_before": self.family_before, "family_after": self.family_after,
            "wait_share": self.wait_share, "waited": self.waited,
            "rl_after_first_seconds": self.rl_after_first_seconds,
            "train_rewards": self.train_rewards, "trained_sessions": self.trained_sessions,
            "lag_shares": self.lag_shares,
            "seconds": self.seconds, "parameters": self.parameters, "shared_prompts": self.shared_prompts,
            "records": [{"version": r.version, "lag": r.lag, "admitted_groups": r.admitted_groups,
                         "resubmissions": r.resubmissions, "cut_groups": r.cut_groups,
                         "abandoned_groups": r.abandoned_groups, "waited": r.waited, "pushed": r.pushed}
                        for r in self.records],
        }


# ----- pieces --------------------------------------------------------------------------------


def _fleet(config: RLVRConfig) -> SandboxFleet:
    return SandboxFleet(sandbox_runner(config.runner), limits=SANDBOX_LIMITS, workers=config.sandbox_workers)


def _output(config: RLVRConfig) -> Path | None:
    if config.output_dir is None:
        return None
    out = Path(config.output_dir)
    if out.exists() and any(out.iterdir()):
        # The trainers resume from checkpoints they find there, which would skip this run's training.
        raise ValueError(f"output_dir {out} is not empty; give a new or empty directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


# ----- the run -------------------------------------------------------------------------------


@dataclasses.dataclass
class WarmStart:
    """The SFT-trained starting point of a run: tasks, tokenizer, decoder and its variables (host arrays).

    train: the tasks SFT and GRPO read; held_out: the evaluation tasks (another seed's
    draws); width: the packed row width (longest prompt plus the response budget); seconds: the SFT's wall time.
    """

    config: RLVRConfig
    tokenizer: object
    train: list[VerifiableTask]
    held_out: list[VerifiableTask]
    model: object
    width: int
    params: object
    seconds: float


def warm_start(config: RLVRConfig, output_dir: Path | None = None) -> WarmStart:
    """Build the tasks and the decoder and run the SFT warm start on the demonstrations (answers only)."""
    started = time.perf_counter()
    tokenizer = task_tokenizer()
    train, held_out = built_in_tasks(config)
    prompt_len = max(len(tokenizer.encode(t.prompt, add_special_tokens=False)) for t in train + held_out)
    width = prompt_len + config.max_new_tokens  # one chain: the prompt, then the response
    model = decoder(len(tokenizer), max_seq_len=width)
    params = rlvr_recipe.warm_start(model, tokenizer, train, width, config.sft_steps, config.sft_batch,
                             config.sft_learning_rate, key=jax.random.fold_in(jax.random.key(config.seed), 1),
                             seed=config.seed, output_dir=output_dir, progress=config.progress,
                             errors=config.sft_errors)
    return WarmStart(config=config, tokenizer=tokenizer, train=train, held_out=held_out, model=model, width=width,
                     params=params, seconds=time.perf_counter() - started)


def run(config: RLVRConfig = RLVRConfig(), warm: WarmStart | None = None) -> RLVRResult:
    """SFT warm start, evaluation reward, GRPO through the scheduler, evaluation reward again (module docstring).

    ``warm``: a :func:`warm_start` to begin from instead of running one (the bench gives
    both of its runs the same); it must come from a config with the same seed, tasks,
    SFT and budget, which is checked.
    """
    if not isinstance(config, RLVRConfig):
        raise TypeError(f"run needs an RLVRConfig, got {type(config).__name__}")
    if warm is not None:
        fields = ("seed", "train_tasks", "eval_tasks", "max_new_tokens", "sft_steps", "sft_batch", "sft_learning_rate",
                  "sft_errors")
        differ = [f for f in fields if getattr(warm.config, f) != getattr(config, f)]
        if differ:
            raise ValueError(f"the warm start was made with other {differ} than this config")
    out = _output(config)
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    if warm is None:
        warm = warm_start(config, None if out is None else out / "sft")
        seconds["sft"] = warm.seconds
    else:
        seconds["sft"] = 0.0
    tokenizer, train, held_out, model, width, params = (warm.tokenizer, warm.train, warm.held_out, warm.model,
                                                        warm.width, warm.params)
    prompt_len = width - config.max_new_tokens
    parameters = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    fleet = _fleet(config)
    reward = verifiable_reward(fleet)

    sampling = rollout_sampling(config, (tokenizer.eos_token_id,))
    server = NativeRolloutServer(Server(model, params, sampling, slots=config.slots, capacity=width,
                                        batch_invariant=config.deterministic), version=0)
    try:
        mark = time.perf_counter()
        eval_seed = config.seed + 1
        held_rows = task_rows(held_out)
        held_ids = [tokenizer.encode(task.prompt, add_special_tokens=False) for task in held_out]
        measure = functools.partial(measure_reward, server, reward, tokenizer.decode, held_rows, held_ids,
                                    config.eval_samples, config.max_new_tokens, eval_seed, (tokenizer.eos_token_id,))
        before = measure()
        seconds["eval_before"] = time.perf_counter() - mark

        # 2. GRPO through the scheduler. In file order the families alternate, so every batch (of an even
        # size) holds both equally and the training reward of one batch compares with the next.
        mark = time.perf_counter()
        job = grpo_job(config, model, params, tokenizer, task_rows(train), prompt_len, server, reward,
                       loading=Loading(shuffle=False), score_workers=max(2, config.sandbox_workers),
                       progress=config.progress,
                       output_dir=None if out is None else out / "grpo")
        try:
            state = job.trainer.fit(job.data, steps=config.steps, log_every=max(1, config.steps // 4))
        finally:
            job.close()
        records, entered, trained = job.records, job.entered, job.sessions
        finished = time.perf_counter()
        seconds["grpo"] = finished - mark
        waited = sum(r.waited for r in records[1:])
        after_first = finished - entered[1] if len(entered) > 1 else 0.0
        share = waited / after_first if after_first > 0 else float("nan")

        # 3. The final weights (the scheduler pushed only those it sampled from) and the same measurement.
        mark = time.perf_counter()
        server.load(jax.tree.map(jnp.copy, state.params), int(state.updates))
        after = measure()
        seconds["eval_after"] = time.perf_counter() - mark
    finally:
        server.close()
        fleet.close()
    seconds["total"] = time.perf_counter() - started
    result = RLVRResult(
        config=config, reward_before=before["all"], reward_after=after["all"], family_before=before,
        family_after=after, wait_share=share, waited=waited, rl_after_first_seconds=after_first, records=records,
        train_rewards=[r.metrics.get("reward/mean", float("nan")) for r in records], trained_sessions=trained,
        lag_shares=job.lag_shares,
        seconds=seconds, parameters=parameters, shared_prompts=shared_prompts(held_out, train),
    )
    if out is not None:
        (out / "result.json").write_text(json.dumps(result.summary(), indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = RLVRConfig()
    parser.add_argument("--steps", type=int, default=default.steps, help="GRPO updates")
    parser.add_argument("--seed", type=int, default=default.seed)
    parser.add_argument("--max-lag", type=int, default=default.max_lag,
                        help="updates a rollout may lag the trainer (>= ahead + sync_every - 1)")
    parser.add_argument("--ahead", type=int, default=default.ahead, help="batches submitted ahead of training")
    parser.add_argument("--sft-steps", type=int, default=default.sft_steps, help="warm-start SFT steps")
    parser.add_argument("--runner", choices=RUNNERS, default=default.runner,
                        help="sandbox for the code tasks ('process' isolates nothing: trusted code only)")
    parser.add_argument("--output-dir", default=None, help="write metrics, checkpoints and result.json here")
    args = parser.parse_args(argv)
    try:
        config = RLVRConfig(steps=args.steps, seed=args.seed, max_lag=args.max_lag, ahead=args.ahead,
                            sft_steps=args.sft_steps, runner=args.runner, output_dir=args.output_dir)
    except ValueError as error:
        parser.error(str(error))
    print(f"train_rlvr: {config.steps} GRPO updates of {config.tasks_per_step} tasks x {config.samples} samples, "
          f"max_lag={config.max_lag}, ahead={config.ahead}, seed={config.seed}, {jax.device_count()} device(s)",
          flush=True)
    result = run(config)
    s = result.seconds
    print(f"decoder: {result.parameters:,} parameters; SFT warm start {config.sft_steps} steps in {s['sft']:.1f} s")
    shared = result.shared_prompts
    print(f"evaluation reward, {config.eval_tasks} tasks x {config.eval_samples} samples at temperature 1 "
          f"({shared} of the {config.eval_tasks} prompts also occur among the training tasks):")
    for family in result.family_before:
        print(f"  {family:<5} {result.family_before[family]:.3f} -> {result.family_after[family]:.3f}")
    trained = [r for r in result.train_rewards if np.isfinite(r)]
    quarter = max(1, len(trained) // 4)
    print(f"training-batch reward: first {quarter} batches {np.mean(trained[:quarter]):.3f}, "
          f"last {quarter} {np.mean(trained[-quarter:]):.3f}")
    lags = [r.lag for r in result.records if r.lag is not None]
    resubmitted = sum(sum(r.resubmissions.values()) for r in result.records)
    print(f"rollouts: max lag {max(lags, default=0)}, {resubmitted} resubmitted, "
          f"{sum(r.cut_groups for r in result.records)} groups cut")
    print(f"trainer waited {result.waited:.1f} s of {result.rl_after_first_seconds:.1f} s after its first update: "
          f"wait share {100 * result.wait_share:.1f}%")
    print(f"GRPO {s['grpo']:.1f} s; total {s['total']:.1f} s")
    if config.output_dir:
        print(f"wrote {Path(config.output_dir) / 'result.json'}")
    if not result.reward_after > result.reward_before:
        print("note: the evaluation reward did not rise in this run", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
