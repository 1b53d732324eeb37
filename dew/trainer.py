"""The Trainer: one compiled update per batch shape, for every objective.

``Trainer(objective, optimizer, key=...)`` drives any objective that follows
:mod:`dew.objectives.base`. ``fit(data, steps, log_every)`` runs the loop. The loop is
:meth:`Trainer.start`, public for an actor or a notebook that drives training one batch at
a time: ``run = trainer.start(data)`` restores the newest checkpoint of ``output_dir`` (state
and data position) or starts afresh, ``run.step()`` consumes the next batch, ``run.save()``
checkpoints, ``run.close()`` releases the checkpoint files. Below it, ``initial_state()``,
``step(state, batch)``, ``evaluate(state, data)``, ``save`` and ``restore`` work on states.

What a step does, on the host and then compiled:

1. the objective checks the host batch (``validate``);
2. with a rollout, ``rollout(batch, variables, version, key)`` turns the data batch
   into the batch to train on (``version`` is ``TrainState.updates``); a rollout whose
   ``takes_step`` is true also gets ``step=TrainState.step``, the attempted-work clock
   (EpisodeRollout puts it in its episode identities); when it returns ``None`` the step
   consumes the batch but makes no update;
3. the batch rows are split over the mesh's ``data`` x ``fsdp`` axes (global rows must divide
   their size); parameters, optimizer state, EMA and gradient sums are placed by
   :mod:`dew.parallelism`'s rule table (``parallelism=Parallelism(fsdp=8)`` shards them;
   the default replicates them, plain data parallelism);
4. the jitted update computes the loss and gradients; with ``accumulate=k`` it adds
   them to a running sum and commits one optimizer update every k batches, so
   ``TrainState.step`` counts batches and ``TrainState.updates`` committed updates;
5. after each committed update the EMA slot moves by the objective's ``ema_decay``
   (``None``: no copy; a float: moving average; exactly 1: a frozen reference);
6. with ``record=DIR`` the batch the update trained on is written to the run's record
   (:mod:`dew.update_record`), which :func:`dew.replay.replay` trains again bit for bit.

The update donates the state it is given: ``step(state, batch)`` consumes ``state``.
Trees the caller passed in (``pretrained=``) are copied when the state is built, so
they stay usable. A non-finite loss stops training with an error naming the step.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from dew.checkpoint import Checkpoints
from dew.update_record import UpdateRecord
from dew.data.dataset import Batch, Dataset, Partition, TrainStream
from dew.objectives.base import Objective, Variables
from dew.parallelism import Parallelism, ShardingPlan, placed, plan_shardings
from dew.sharding import (
    describe_error,
    exchange,
    local_partition,
    raise_failures,
    replicated,
    row_sharded,
    shard_batch,
)
from dew.experiment_trackers import ExperimentTracker, trackers_of
from dew.tracking import Tracker
from dew.validation import positive_int

log = logging.getLogger(__name__)

# CPU backends cannot always reuse donated buffers; that costs memory, not correctness.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


@struct.dataclass
class TrainState:
    """Everything training needs to continue, as device arrays.

    params: the full Flax variables mapping (with its outer ``params`` collection).
    ema: the averaged or frozen copy the objective asked for, or None.
    step: batches consumed; updates: optimizer updates committed.
    grad_sum, micro: the gradient sum and batch count of an open accumulation window
    (None without accumulation).
    """

    params: Any
    opt_state: Any
    ema: Any
    step: jax.Array
    updates: jax.Array
    key: jax.Array
    grad_sum: Any = None
    micro: jax.Array | None = None


class Rollout(Protocol):
    """Turns the next data batch into the batch to train on, on the host.

    ``variables`` is the live policy, valid while the call runs (copy it to keep it);
    ``version`` is the number of committed updates behind it. Returning ``None``
    skips the update for this batch. A rollout with ``takes_step = True`` is called with
    ``step=`` as well: the batches consumed before this one, counting steps that made no
    update.
    """

    def __call__(self, batch: Batch, variables: Variables, version: int, key: jax.Array) -> Batch | None: ...


class Trainer:
    """Training of one objective with one optax optimizer over a device mesh.

    key: a JAX PRNG key; the initial variables and every step's randomness derive from it.
    rollout: a :class:`Rollout` called before each update (RL objectives), or None.
    accumulate: batches per optimizer update (gradient accumulation), default 1.
    output_dir: where checkpoints and ``metrics.jsonl`` go; None writes nothing to disk.
    checkpoint_every: steps between checkpoints when ``output_dir`` is set (and one at the end).
    devices: the devices of the mesh (default: all devices of all processes).
    parallelism: how the mesh splits them (:class:`~dew.parallelism.Parallelism`: ``data``, ``fsdp`` and
    ``tensor`` sizes); default: every device along ``data``, the state replicated.
    progress: show a progress bar in ``fit``.
    trackers: experiment trackers that receive ``fit``'s records beside ``metrics.jsonl``:
    names ("tensorboard", "wandb") or :class:`~dew.experiment_trackers.TensorBoard` /
    :class:`~dew.experiment_trackers.WandB` settings; they write under ``output_dir``.
    record: a folder where every step's trained batch is recorded (:mod:`dew.update_record`), so that
    :func:`dew.replay.replay` can train the run again without its rollout; None records nothing.
    """

    def __init__(
        self,
        objective: Objective,
        optimizer: optax.GradientTransformation,
        *,
        key: jax.Array,
        rollout: Rollout | Callable | None = None,
        accumulate: int = 1,
        output_dir: str | Path | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int | None = 3,
        devices=None,
        parallelism: Parallelism | None = None,
        progress: bool = True,
        trackers: Sequence[str | ExperimentTracker] = (),
        record: str | Path | None = None,
    ):
        positive_int("accumulate", accumulate)
        trackers = trackers_of(trackers)
        if trackers and output_dir is None:
            raise ValueError(f"trackers={[str(t) for t in trackers]} need an output_dir to write their records in")
        if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or checkpoint_every < 1):
            raise ValueError(f"checkpoint_every must be a positive integer or None, got {checkpoint_every!r}")
        if checkpoint_every is not None and output_dir is None:
            raise ValueError("checkpoint_every needs an output_dir to write checkpoints to")
        if rollout is not None and not callable(rollout):
            raise TypeError(f"rollout must be callable, got {type(rollout).__name__}")
        if not hasattr(optimizer, "init") or not hasattr(optimizer, "update"):
            raise TypeError(f"optimizer must be an optax GradientTransformation, got {type(optimizer).__name__}")
        self.objective = objective
        self.optimizer = optimizer
        self.rollout = rollout
        self.accumulate = accumulate
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.checkpoint_every = checkpoint_every
        self.keep_checkpoints = keep_checkpoints
        self.progress = progress
        self.trackers = trackers
        self.record = None if record is None else UpdateRecord(record)
        if parallelism is not None and not isinstance(parallelism, Parallelism):
            raise TypeError(f"parallelism must be a dew.parallelism.Parallelism, got {type(parallelism).__name__}")
        self.parallelism = parallelism or Parallelism()
        self.mesh = self.parallelism.mesh(devices)
        self._replicated = replicated(self.mesh)
        self._key = _as_key(key)
        #: where each leaf of the state lives (TrainState's tree of NamedShardings, and what the rules left whole)
        self._state_shapes = jax.eval_shape(self._state_from_key, self._key)
        self.plan: ShardingPlan = plan_shardings(self._state_shapes, self.mesh)
        self._update = jax.jit(self._update_fn, donate_argnums=0, out_shardings=(self.plan.shardings, self._replicated))
        self._evaluate = jax.jit(objective.evaluate)
        # The state is built in two programs: the parameters' initialisers hold temporaries (random
        # bits) of about twice the parameters' size, which would otherwise be live beside the
        # optimizer's moments (a Qwen3-0.6B shape's first step peaked at 11.4 GiB resident in
        # initialisation, 8.7 GiB in its updates).
        self._init_params = jax.jit(self._params_from_key, out_shardings=self.plan.shardings.params)
        self._init_state = jax.jit(self._state_around, donate_argnums=0, out_shardings=self.plan.shardings)

    # ----- building states -------------------------------------------------------------------

    def _state_from_key(self, key: jax.Array) -> TrainState:
        return self._state_around(self._params_from_key(key), key)

    def _params_from_key(self, key: jax.Array):
        init_key, _ = jax.random.split(key)
        # Copy so that donating the state never consumes a tree the caller owns (pretrained=).
        return jax.tree.map(jnp.copy, self.objective.init(init_key))

    def _state_around(self, params, key: jax.Array) -> TrainState:
        """The state around freshly initialised ``params`` (consumed): optimizer state, EMA and counters."""
        _, run_key = jax.random.split(key)
        decay = self.objective.ema_decay
        accumulating = self.accumulate > 1
        return TrainState(
            params=params,
            opt_state=self.optimizer.init(params),
            ema=None if decay is None else jax.tree.map(jnp.copy, self.objective.reference(params)),
            step=jnp.zeros((), jnp.int32),
            updates=jnp.zeros((), jnp.int32),
            key=run_key,
            grad_sum=jax.tree.map(jnp.zeros_like, params) if accumulating else None,
            micro=jnp.zeros((), jnp.int32) if accumulating else None,
        )

    def initial_state(self) -> TrainState:
        """The state before any step, placed on the mesh by the plan; ``fit`` starts from the same one."""
        return self._init_state(self._init_params(self._key), self._key)

    def step_memory(self, batch: Mapping[str, Any]) -> dict[str, int]:
        """XLA's memory analysis of one compiled update, in bytes per device, for a global batch of these shapes.

        ``batch`` maps each field to an array or a ``jax.ShapeDtypeStruct`` of the global batch; nothing of the
        state is allocated (the update is lowered over abstract arrays), so this sizes models that do not fit.
        Returns arguments (state and batch), outputs, temporaries, aliased (outputs written over donated
        arguments) and peak = arguments + outputs + temporaries - aliased.
        """
        state = placed(self._state_shapes, self.plan.shardings)
        rows = row_sharded(self.mesh)
        batch = {name: jax.ShapeDtypeStruct(tuple(value.shape), value.dtype, sharding=rows) for name, value in batch.items()}
        with jax.set_mesh(self.mesh):
            analysis = self._update.lower(state, batch).compile().memory_analysis()
        memory = {
            "arguments": int(analysis.argument_size_in_bytes),
            "outputs": int(analysis.output_size_in_bytes),
            "temporaries": int(analysis.temp_size_in_bytes),
            "aliased": int(analysis.alias_size_in_bytes),
        }
        memory["peak"] = memory["arguments"] + memory["outputs"] + memory["temporaries"] - memory["aliased"]
        return memory

    # ----- the compiled update ---------------------------------------------------------------

    def _apply(self, state: TrainState, grads) -> tuple[Any, Any, Any]:
        """Commit one optimizer update; returns the new params, optimizer state and EMA."""
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        decay = self.objective.ema_decay
        if decay is None or decay == 1.0:
            ema = state.ema  # none kept, or a frozen reference that must stay bit-identical
        else:
            ema = jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, state.ema, self.objective.reference(params))
        return params, opt_state, ema

    def _update_fn(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        key = jax.random.fold_in(jax.random.fold_in(state.key, state.step), 0)
        grad_fn = jax.value_and_grad(self.objective.loss, has_aux=True)
        (loss, metrics), grads = grad_fn(state.params, state.ema, batch, key)
        # Gradients take the parameters' sharding: under fsdp each device reduces only its own slice of them.
        grads = jax.lax.with_sharding_constraint(grads, self.plan.shardings.params)
        metrics = {"loss": loss, **metrics}
        if self.accumulate == 1:
            params, opt_state, ema = self._apply(state, grads)
            state = state.replace(
                params=params, opt_state=opt_state, ema=ema, step=state.step + 1, updates=state.updates + 1
            )
            return state, metrics

        grad_sum = jax.tree.map(jnp.add, state.grad_sum, grads)
        micro = state.micro + 1

        def commit(operands):
            state, grad_sum = operands
            mean = jax.tree.map(lambda g: g / self.accumulate, grad_sum)
            params, opt_state, ema = self._apply(state, mean)
            return state.replace(
                params=params,
                opt_state=opt_state,
                ema=ema,
                updates=state.updates + 1,
                grad_sum=jax.tree.map(jnp.zeros_like, grad_sum),
                micro=jnp.zeros_like(micro),
            )

        def hold(operands):
            state, grad_sum = operands
            return state.replace(grad_sum=grad_sum, micro=micro)

        state = jax.lax.cond(micro == self.accumulate, commit, hold, (state, grad_sum))
        return state.replace(step=state.step + 1), metrics

    # ----- step-wise API ---------------------------------------------------------------------

    def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, float]]:
        """Consume one data batch: rollout (if any), then one compiled update (:meth:`update`).

        ``state`` is donated to the update and must not be used afterwards. Returns the
        new state and the step's metrics as host floats (empty when the rollout
        returned nothing and no update was made); with a rollout, ``seconds/rollout`` (its call, a
        scheduler's weight push and wait included) and ``seconds/update`` (the compiled update, until its
        metrics reached the host). With ``record`` the trained batch is recorded.
        """
        step, updates = int(state.step), int(state.updates)
        if self.record is not None and not self.record.opened:  # a first step: a run's start, or a resumed run
            self.record.open(state.params, step, dict(self.mesh.shape))
        began = time.perf_counter()
        if self.rollout is not None:
            rollout_key = jax.random.fold_in(jax.random.fold_in(state.key, step), 1)
            clocks = {"step": step} if getattr(self.rollout, "takes_step", False) else {}
            batch = self.rollout(batch, state.params, updates, rollout_key, **clocks)
            if batch is None:
                if self.record is not None:
                    self.record.write(step, updates, None, None, {})
                return state.replace(step=state.step + 1), {}
        rolled = time.perf_counter()
        state, metrics = self.update(state, batch)
        if self.rollout is not None:  # where an RL step's time went
            metrics.update({"seconds/rollout": rolled - began, "seconds/update": time.perf_counter() - rolled})
        # A rollout that keeps its batch's figures (rewards, response lengths) has them logged with the update's.
        if self.rollout is not None and isinstance(getattr(self.rollout, "metrics", None), Mapping):
            metrics.update({f"rollout/{name}": float(value) for name, value in self.rollout.metrics.items()})
        if self.record is not None:  # its cost is logged with the update's figures
            began = time.perf_counter()
            written = self.record.write(step, updates, batch, state.params, metrics)
            metrics.update({"record/bytes": float(written), "record/seconds": time.perf_counter() - began})
        return state, metrics

    def update(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, float]]:
        """One compiled update on ``batch`` as given (no rollout); ``state`` is donated. Returns the new state and
        the update's metrics as host floats."""
        step = int(state.step)
        self._validate(batch, step)
        with jax.set_mesh(self.mesh):  # the model marks its activations' rows on this mesh (constrain_rows)
            state, metrics = self._update(state, shard_batch(batch, self.mesh))
        metrics = {name: float(value) for name, value in jax.device_get(metrics).items()}
        if not math.isfinite(metrics["loss"]):
            raise FloatingPointError(
                f"the loss became {metrics['loss']} at step {step + 1} (batch {step} of this run's stream); "
                "training stopped. Lower the learning rate or check the batch for bad values."
            )
        return state, metrics

    def _validate(self, batch: Batch, step: int) -> None:
        """Check the host batch; on several processes a bad batch on one raises on all (none waits in the update)."""
        if jax.process_count() == 1:
            self.objective.validate(batch)
            return
        error = None
        try:
            self.objective.validate(batch)
        except Exception as failure:  # noqa: BLE001 - shared with the other processes, then raised
            error = failure
        raise_failures(exchange({"error": describe_error(error)}), error, f"checking the batch of step {step + 1}")

    def evaluate(self, state: TrainState, data: Dataset, partition: Partition | None = None) -> dict[str, float]:
        """Validation metrics over every batch of ``data.val``; with a moving EMA also ``ema/...``."""
        if data.val is None:
            raise ValueError("the dataset has no validation split (Dataset.val is None)")
        partition = partition or local_partition()
        trees = {"": state.params}
        decay = self.objective.ema_decay
        if decay is not None and decay < 1.0:
            trees["ema/"] = state.ema
        totals: dict[str, dict[str, float]] = {prefix: {} for prefix in trees}
        batches = 0
        for batch in data.val(partition):
            self.objective.validate(batch)
            sharded = shard_batch(batch, self.mesh)
            for prefix, variables in trees.items():
                sums = jax.device_get(self._evaluate(variables, sharded))
                for name, value in sums.items():
                    totals[prefix][name] = totals[prefix].get(name, 0.0) + float(value)
            batches += 1
        if batches == 0:
            raise ValueError("the validation split yielded no batches")
        metrics = {}
        for prefix, sums in totals.items():
            for name, value in self.objective.summarize(sums).items():
                metrics[prefix + name] = float(value)
        return metrics

    def save(self, state: TrainState, directory: str | Path, position: Any = None) -> None:
        """Write ``state`` (and an optional data position) as a checkpoint numbered by its step."""
        checkpoints = Checkpoints(directory, keep=self.keep_checkpoints)
        try:
            checkpoints.save(int(state.step), self._plain(state), position)
        finally:
            checkpoints.close()

    def restore(self, directory: str | Path, step: int | None = None) -> tuple[TrainState, Any]:
        """Read a checkpoint (default: the newest) as ``(state, data position)``."""
        checkpoints = Checkpoints(directory, keep=self.keep_checkpoints)
        try:
            return self._restore_from(checkpoints, step)
        finally:
            checkpoints.close()

    def _plain(self, state: TrainState) -> TrainState:
        """The state with its PRNG key as raw data, the form checkpoints store."""
        return state.replace(key=jax.random.key_data(state.key))

    def _restore_from(self, checkpoints: Checkpoints, step: int | None = None) -> tuple[TrainState, Any]:
        # The template takes this Trainer's plan, so a checkpoint written on another mesh restores onto this one.
        shapes = jax.eval_shape(lambda key: self._plain(self._state_from_key(key)), self._key)
        template = placed(shapes, plan_shardings(shapes, self.mesh).shardings)
        plain, position = checkpoints.restore(template, step)
        key = jax.random.wrap_key_data(plain.key, impl=jax.random.key_impl(self._key))
        return plain.replace(key=key), position

    # ----- the loop --------------------------------------------------------------------------

    def start(self, data: Dataset, partition: Partition | None = None) -> TrainingRun:
        """A run over ``data``'s training stream: the newest checkpoint of ``output_dir`` (state and data position)
        when there is one, the initial state otherwise. ``fit`` drives one; close it when done."""
        return TrainingRun(self, data, partition)

    def fit(
        self,
        data: Dataset,
        steps: int,
        log_every: int = 100,
        eval_every: int | None = None,
    ) -> TrainState:
        """Train until ``steps`` batches have been consumed in total and return the state.

        With an output directory that already holds a checkpoint, training restores
        the newest one and the data position, and continues to ``steps``.
        """
        if not isinstance(data, Dataset):
            raise TypeError(f"fit needs a dew.Dataset, got {type(data).__name__}")
        for name, value in (("steps", steps), ("log_every", log_every)):
            positive_int(f"{name}", value)
        if eval_every is not None and (not isinstance(eval_every, int) or eval_every < 1):
            raise ValueError(f"eval_every must be a positive integer or None, got {eval_every!r}")
        with self.start(data) as run:
            step = run.steps
            tracker = Tracker(
                total=steps, start=step, output_dir=self.output_dir, enabled=run.partition.index == 0,
                progress=self.progress, trackers=self.trackers,
            )
            try:
                while step < steps:
                    metrics = run.step()
                    step += 1
                    tracker.advance(metrics.get("loss"))
                    if step % log_every == 0 or step == steps:
                        tracker.log("train", step, {"updates": int(run.state.updates), **metrics})
                    if eval_every is not None and data.val is not None and step % eval_every == 0:
                        tracker.log("val", step, self.evaluate(run.state, data, run.partition))
                    if self.output_dir is not None and self.checkpoint_every and step % self.checkpoint_every == 0:
                        run.save()
                if self.output_dir is not None:
                    run.save()
            finally:
                tracker.close()
            return run.state


class TrainingRun:
    """One run of a Trainer over a Dataset's training stream (``Trainer.start``; see the module docstring).

    state: the current TrainState; steps: batches consumed (``state.step``); restored: whether
    the run resumed a checkpoint; stream: the training stream, positioned after the batches
    the state consumed. On several processes every process drives its own run in step.
    """

    def __init__(self, trainer: Trainer, data: Dataset, partition: Partition | None = None):
        if not isinstance(data, Dataset):
            raise TypeError(f"a training run needs a dew.Dataset, got {type(data).__name__}")
        self.trainer, self.data = trainer, data
        self.partition = partition or local_partition()
        self.stream = TrainStream(data, self.partition)
        self._checkpoints = None
        if trainer.output_dir is not None:
            self._checkpoints = Checkpoints(trainer.output_dir, keep=trainer.keep_checkpoints)
        self.restored = self._checkpoints is not None and self._checkpoints.latest_step() is not None
        if self.restored:
            self.state, position = trainer._restore_from(self._checkpoints)
            self.stream.restore(position)
            log.info("restored step %d from %s", int(self.state.step), trainer.output_dir)
        else:
            self.state = trainer.initial_state()

    @property
    def steps(self) -> int:
        return int(self.state.step)

    def step(self) -> dict[str, float]:
        """Consume the next batch of the stream (``Trainer.step``); returns its metrics."""
        batch = next(self.stream)
        if self.data.batch is not None:
            _check_rows(batch, self.data.batch, self.partition)
        self.state, metrics = self.trainer.step(self.state, batch)
        return metrics

    def save(self) -> int:
        """Checkpoint the state and the data position into the Trainer's output_dir; returns the step."""
        if self._checkpoints is None:
            raise ValueError("the Trainer has no output_dir to save checkpoints in")
        step = self.steps
        self._checkpoints.save(step, self.trainer._plain(self.state), self.stream.position())
        return step

    def close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.close()
            self._checkpoints = None

    def __enter__(self) -> TrainingRun:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_key(key) -> jax.Array:
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    if isinstance(key, (jax.Array, np.ndarray)) and key.dtype == np.uint32:
        return jax.random.wrap_key_data(key)
    raise TypeError(f"key must be a JAX PRNG key such as jax.random.key(0), got {key!r}")


def _check_rows(batch: Mapping[str, np.ndarray], global_rows: int, partition: Partition) -> None:
    if not batch:
        raise ValueError("the training stream yielded an empty batch")
    rows = len(next(iter(batch.values())))
    if rows * partition.count != global_rows:
        raise ValueError(
            f"the training stream yielded {rows} rows on each of {partition.count} process(es), "
            f"but Dataset.batch is {global_rows}"
        )
