"""``FlowRollout``: Flow-GRPO's groups of samples, scored and turned into a fixed-shape training batch.

``FlowRollout(objective, reward, groups=G, steps=S, train_steps=None)`` is the Trainer's rollout
for :class:`~dew.objectives.flow_grpo.FlowGRPOObjective`. For a data batch of B source rows it

1. repeats each source row G times, contiguously (row b's group is rows b G .. b G + G - 1),
   and samples every row with the live policy along ``S`` time points (S - 1 stochastic
   transitions) with :func:`~dew.flow.trajectory.sample_trajectory`, row r's noise drawn from
   ``fold_in(key, r)`` with r its global row;
2. calls ``reward(images, batch)`` once with the decoded samples (float32 ``[B G, *field shape]``
   in [-1, 1]) and the repeated source batch, and takes back one finite real score per
   sample; anything else (the wrong shape, a non-number, NaN or inf) is refused, naming the row;
3. turns the scores, kept float64 throughout, into group advantages with the population
   standard deviation and epsilon 1e-4 (:func:`~dew.losses.advantages.population_group_advantages`),
   then casts them to float32 for training;
4. returns, per sample row, the first ``train_steps`` transitions (None: all S - 1): states,
   next states, times, sigma_t, the per-coordinate log density of each draw, the advantage, a
   0/1 ``transition_mask`` (deterministic transitions and zero-advantage rows cleared: those
   rows stay in the fixed-shape batch and train nothing), ``rewards`` (float64) and the
   condition columns. The source batch's generated field only counts rows; nothing trains on it.

On several processes every rank samples (one jitted run over the global, row-sharded batch),
gathers the full trajectory to host memory and keeps its own rows, so host memory grows with
the global rollout. Rank zero gathers every rank's source rows, runs the reward on the whole
batch and sends the float64 scores to the others as bytes; a reward that fails there raises
on every rank. Each process returns its own rows in the order its source rows came.

``metrics`` holds the last batch's "reward/mean", "reward/std" and "advantage/zero_share";
``scores`` its float64 scores (this process's rows).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from dew.losses.advantages import population_group_advantages
from dew.sharding import collective_host, data_mesh, describe_error, exchange, mesh_of, raise_failures, shard_batch
from dew.validation import integer


class FlowRollout:
    """Sample, score and batch Flow-GRPO groups (see the module docstring)."""

    def __init__(self, objective, reward: Callable, groups: int, steps: int, train_steps: int | None = None,
                 devices=None):
        for name in ("generate", "inputs", "process"):
            if not hasattr(objective, name):
                raise TypeError(f"FlowRollout needs a FlowGRPOObjective, got {type(objective).__name__}")
        if not callable(reward):
            raise TypeError(f"reward must be callable as reward(images, batch) -> scores, got {reward!r}")
        integer("groups", groups, at_least=2, why="advantages compare the samples of one source row")
        integer("steps", steps, at_least=2, why="time points including both endpoints")
        if train_steps is not None:
            integer("train_steps", train_steps, at_least=1)
            if train_steps > steps - 1:
                raise ValueError(f"train_steps must be at most the {steps - 1} transitions of steps={steps}, "
                                 f"got {train_steps}")
        self.objective = objective
        self.reward = reward
        self.groups = groups
        self.steps = steps
        self.train_steps = steps - 1 if train_steps is None else train_steps
        self.mesh = data_mesh(devices)
        self._sample = jax.jit(self._sample_rows)
        self.metrics: dict[str, float] = {}
        self.scores = np.zeros(0, np.float64)

    def _sample_rows(self, variables, columns, key):
        keys = jax.vmap(lambda row: jax.random.fold_in(key, row))(columns["row"])
        trajectory = self.objective.generate(variables, columns, keys, self.steps, stochastic=True)
        images = self.objective.inputs.decode(trajectory.samples)
        # per-coordinate log densities, as the objective computes them for the ratio
        coordinates = int(np.prod(self.objective.inputs.latent_shape))
        return trajectory, trajectory.log_densities / coordinates, images

    def __call__(self, batch, variables, version: int, key: jax.Array) -> dict[str, np.ndarray]:
        inputs = self.objective.inputs
        processes, process = jax.process_count(), jax.process_index()
        error, local = None, 0
        try:
            local = inputs.rows(batch, "FlowRollout")
        except Exception as failure:  # noqa: BLE001 - shared with the other processes, then raised
            error = failure
        if processes > 1:
            everyone = exchange({"rows": local, "error": describe_error(error)})
            raise_failures(everyone, error, "reading the Flow-GRPO source batch")
            if len({theirs["rows"] for theirs in everyone}) != 1:
                raise ValueError(f"every process must read as many source rows; got {[t['rows'] for t in everyone]}")
        elif error is not None:
            raise error
        rows = local * self.groups
        offset = process * rows
        repeated = {name: np.repeat(np.asarray(value), self.groups, axis=0) for name, value in batch.items()}
        columns = {c.name: repeated[c.name].astype(np.int32) for c in inputs.conditions}
        columns["row"] = np.arange(offset, offset + rows, dtype=np.int32)
        # The rows go on the trainer's mesh (the variables'), whatever its axes; unsharded variables take this rollout's.
        mesh = mesh_of(variables, self.mesh)
        trajectory, densities, images = collective_host(self._sample(variables, shard_batch(columns, mesh), key))
        mine = slice(offset, offset + rows)
        scores = self._scores(images, repeated, processes)[mine]
        advantages = population_group_advantages(scores, self.groups)
        k = self.train_steps
        stochastic = np.asarray(trajectory.stochastic[:k])
        mask = stochastic[None, :] & (advantages != 0)[:, None]
        column = lambda values: np.broadcast_to(np.asarray(values, np.float32)[None], (rows, k)).copy()  # noqa: E731
        self.scores = scores
        self.metrics = {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()),
                        "advantage/zero_share": float(np.mean(advantages == 0))}
        return {
            "states": np.asarray(trajectory.states[mine, :k], np.float32),
            "next_states": np.asarray(trajectory.states[mine, 1:k + 1], np.float32),
            "times": column(trajectory.times[:k]),
            "next_times": column(trajectory.times[1:k + 1]),
            "noise": column(trajectory.noise[:k]),
            "log_densities": np.asarray(densities[mine, :k], np.float32),
            "advantages": advantages.astype(np.float32),
            "transition_mask": mask.astype(np.float32),
            "rewards": scores,
            **{c.name: columns[c.name] for c in inputs.conditions},
        }

    def _scores(self, images: np.ndarray, repeated: dict, processes: int) -> np.ndarray:
        """float64 [global rows] scores: the reward runs on rank zero over every rank's rows."""
        if processes == 1:
            return self._call_reward(images, repeated)
        source = {name: np.asarray(multihost_utils.process_allgather(value, tiled=True))
                  for name, value in repeated.items()}
        scores, error = np.zeros(len(images), np.float64), None
        if jax.process_index() == 0:
            try:
                scores = self._call_reward(images, source)
            except Exception as failure:  # noqa: BLE001 - shared with the other processes, then raised
                error = failure
        raise_failures(exchange({"error": describe_error(error)}), error, "scoring the Flow-GRPO samples on rank 0")
        # bytes keep every float64 bit whatever jax's x64 setting would do to a float array
        sent = multihost_utils.broadcast_one_to_all(scores.view(np.uint8))
        return np.asarray(sent, np.uint8).view(np.float64).copy()

    def _call_reward(self, images: np.ndarray, source: dict) -> np.ndarray:
        samples = len(images)
        result = self.reward(np.asarray(images, np.float32), source)
        values = np.asarray(result) if not isinstance(result, (list, tuple)) else np.asarray(result, dtype=object)
        if values.shape != (samples,):
            raise ValueError(f"the reward must return one score per sample, shape ({samples},); got shape {values.shape}")
        scores = np.zeros(samples, np.float64)
        for row, value in enumerate(values.tolist() if values.dtype == object else values):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
                shown = value.item() if isinstance(value, np.generic) else value
                raise TypeError(f"the reward returned {shown!r} for sample row {row} (source row {row // self.groups}, "
                                f"sample {row % self.groups}); a score must be a real number")
            if not np.isfinite(float(value)):
                raise ValueError(f"the reward returned {float(value)} for sample row {row} (source row "
                                 f"{row // self.groups}, sample {row % self.groups}); a score must be finite")
            scores[row] = float(value)
        return scores
