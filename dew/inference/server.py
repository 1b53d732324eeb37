"""Continuous batching: ``Server`` keeps a fixed number of cache slots busy.

A request (context ids, a response budget, a seed) waits in a queue until a slot is
free, joins between two decode steps (its context is prefilled into its slot's cache
row), then gets one token per step until it samples EOS, spends its budget or is
cancelled, and leaves; its slot takes the next request at the following step. Every
step is one compiled call over all slots: sampling is fused into it and the weights
are read once per step for every active request.

Request randomness depends only on its seed: token ``t`` draws with
``fold_in(key(seed), t)``, so a request samples the same tokens alone or beside others.
``reload(variables)`` swaps in new weights between two steps, cast to the served dtype
(train in float32, serve in bfloat16). Serving in bfloat16 also runs the decoder's
weight products on bfloat16 operands with float32 accumulation (``matmul_dtype``),
which CPUs with AVX512-BF16 run about twice as fast as float32 products; norms, rotary,
attention and sampling stay in float32. ``Server.from_task(task, slots=, capacity=)``
builds one from a :class:`ServingTask`.

``lanes`` splits the slots into that many equal groups, each with its own cache, whose
decode steps run at the same time on their own threads. One batched step over many
slots spends much of its time in small kernels that do not use every core; on a
2-core CPU two lanes of 16 slots decode more tokens per second than one step over 32
(bench/serve_throughput.py). A request samples the same with or without lanes, up to
the float rounding a different batch shape brings.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.inference.generation import bucket, sample_rows
from dew.models.transformer import init_cache
from dew.sampling import Sampling


@dataclasses.dataclass(frozen=True)
class ServingTask:
    """What serving needs: the decoder, its variables, the Sampling (with EOS ids) and the served dtype."""

    model: Any
    variables: Any
    sampling: Sampling
    dtype: Any = jnp.float32


@dataclasses.dataclass
class Finished:
    """A request that left its slot: ids, raw and behaviour log-probs, and why it ended."""

    request: int
    ids: list[int]
    old_log_probs: list[float]
    behavior_log_probs: list[float]
    finish_reason: str  # "stop" (EOS), "length" (budget) or "cancelled"

    @property
    def eos(self) -> bool:
        return self.finish_reason == "stop"


@dataclasses.dataclass
class _Active:
    request: int
    budget: int
    ids: list = dataclasses.field(default_factory=list)
    old: list = dataclasses.field(default_factory=list)
    behavior: list = dataclasses.field(default_factory=list)


def cast_floating(variables, dtype):
    """Floating leaves in ``dtype``, others as they are."""

    def cast(leaf):
        leaf = jnp.asarray(leaf)
        return leaf.astype(dtype) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf

    return jax.tree.map(cast, variables)


@partial(jax.jit, static_argnames=("model",), donate_argnames=("cache", "last"))
def _prefill(model, variables, cache, last, tokens, lengths, joining):
    cache = cache.replace(lengths=jnp.where(joining, 0, cache.lengths))
    logits, cache = model.apply(variables, tokens, cache=cache, lengths=lengths)
    rows = jnp.arange(tokens.shape[0])
    return cache, jnp.where(joining[:, None], logits[rows, jnp.maximum(lengths - 1, 0)], last)


@partial(jax.jit, static_argnames=("model", "sampling"), donate_argnames=("cache", "last"))
def _decode(model, variables, cache, last, keys, steps, budgets, active, sampling: Sampling):
    drawn = sample_rows(last, jax.random.wrap_key_data(keys), steps, sampling)
    eos_ids = jnp.asarray(sampling.eos_ids or (-1,), jnp.int32)
    ended = active & jnp.isin(drawn.ids, eos_ids)
    spent = active & (steps + 1 >= budgets)
    feed = active & ~ended & ~spent
    logits, cache = model.apply(variables, drawn.ids[:, None], cache=cache, lengths=feed.astype(jnp.int32))
    last = jnp.where(feed[:, None], logits[:, 0], last)
    return cache, last, drawn.ids, drawn.old_log_probs, drawn.behavior_log_probs, ended


def _rows(values: np.ndarray, rows: int) -> jax.Array:
    """``values`` with inert zero rows appended up to ``rows``."""
    padding = [(0, rows - len(values))] + [(0, 0)] * (values.ndim - 1)
    return jnp.asarray(np.pad(values, padding))


class Server:
    """A fixed number of ``slots``, each a cache row of ``capacity`` positions (see the module docstring)."""

    def __init__(
        self, model, variables, sampling: Sampling, slots: int, capacity: int, dtype=jnp.float32, lanes: int = 1
    ):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be a positive integer, got {slots!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 2:
            raise ValueError(f"capacity must be an integer >= 2, got {capacity!r}")
        if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1 or slots % lanes:
            raise ValueError(f"lanes must be a positive integer that divides slots={slots}, got {lanes!r}")
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a dew.sampling.Sampling, got {type(sampling).__name__}")
        if jnp.dtype(dtype) != jnp.float32 and getattr(model, "matmul_dtype", jnp.float32) is None:
            model = model.clone(matmul_dtype=dtype)  # serve in the served precision: products on its operands
        self.model, self.sampling, self.slots, self.capacity, self.dtype = model, sampling, slots, capacity, dtype
        self.lanes = lanes
        self.variables = cast_floating(variables, dtype)
        width = slots // lanes
        self._lane_slots = [slice(lane * width, (lane + 1) * width) for lane in range(lanes)]
        # A lane computes at least two rows: XLA's CPU products take a slow path for a single row
        # (with bfloat16 weights it even converts every weight to float32 each step); a spare row is nearly free.
        self._rows = max(2, width)
        self._caches = [init_cache(model, self._rows, capacity) for _ in range(lanes)]
        self._lasts = [jnp.zeros((self._rows, model.vocab_size), jnp.float32) for _ in range(lanes)]
        self._pool = ThreadPoolExecutor(lanes, thread_name_prefix="dew-lane") if lanes > 1 else None
        self._keys = np.zeros((slots, *jax.random.key_data(jax.random.key(0)).shape), np.uint32)
        self._steps = np.zeros(slots, np.int32)
        self._budgets = np.zeros(slots, np.int32)
        self._active: list[_Active | None] = [None] * slots
        self._queue: deque = deque()
        self._cancelled: set[int] = set()
        self._numbers = itertools.count()

    @classmethod
    def from_task(cls, task: ServingTask, slots: int, capacity: int, lanes: int = 1) -> "Server":
        return cls(task.model, task.variables, task.sampling, slots=slots, capacity=capacity, dtype=task.dtype,
                   lanes=lanes)

    # ----- requests ------------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int = 0) -> int:
        """Queue a request and return its number; bad requests raise here and touch no slot."""
        ids = np.asarray(list(prompt_ids), np.int64)
        if ids.size == 0:
            raise ValueError("the prompt is empty; a request needs at least one id")
        if ids.ndim != 1 or ids.min() < 0 or ids.max() >= self.model.vocab_size:
            raise ValueError(f"the prompt holds ids outside the vocabulary [0, {self.model.vocab_size})")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if ids.size + max_new_tokens > self.capacity:
            raise ValueError(
                f"a prompt of {ids.size} ids plus a budget of {max_new_tokens} exceeds the cache capacity {self.capacity}"
            )
        number = next(self._numbers)
        self._queue.append((number, ids.astype(np.int32), max_new_tokens, int(seed)))
        return number

    def cancel(self, request: int) -> None:
        """Stop a queued or running request; it leaves at the next step as "cancelled"."""
        self._cancelled.add(request)

    @property
    def busy(self) -> bool:
        return bool(self._queue) or any(a is not None for a in self._active)

    def reload(self, variables) -> None:
        """Serve ``variables`` from the next step on, cast to the served dtype."""
        self.variables = cast_floating(variables, self.dtype)

    # ----- stepping ------------------------------------------------------------------------

    def step(self) -> list[Finished]:
        """Admit waiting requests into free slots, then decode one token for every active slot."""
        finished = self._drop_cancelled()
        self._admit()
        active = np.array([a is not None for a in self._active])
        if not active.any():
            return finished
        lanes = [lane for lane, span in enumerate(self._lane_slots) if active[span].any()]
        if self._pool is None or len(lanes) == 1:
            results = [self._decode_lane(lane, active) for lane in lanes]
        else:
            results = list(self._pool.map(lambda lane: self._decode_lane(lane, active), lanes))
        ids, old, behavior, ended = (np.zeros(self.slots, dtype) for dtype in (np.int32, np.float32, np.float32, bool))
        for lane, result in zip(lanes, results, strict=True):
            span = self._lane_slots[lane]
            ids[span], old[span], behavior[span], ended[span] = result
        for slot in np.flatnonzero(active):
            entry = self._active[slot]
            entry.ids.append(int(ids[slot]))
            entry.old.append(float(old[slot]))
            entry.behavior.append(float(behavior[slot]))
            self._steps[slot] += 1
            if ended[slot] or len(entry.ids) >= entry.budget:
                finished.append(self._leave(slot, "stop" if ended[slot] else "length"))
        return finished

    def _decode_lane(self, lane: int, active: np.ndarray):
        """One decode step of a lane's slots; returns their ids, raw and behaviour log-probs and EOS flags."""
        span = self._lane_slots[lane]
        rows = self._rows
        self._caches[lane], self._lasts[lane], ids, old, behavior, ended = _decode(
            self.model, self.variables, self._caches[lane], self._lasts[lane], _rows(self._keys[span], rows),
            _rows(self._steps[span], rows), _rows(self._budgets[span], rows), _rows(active[span], rows), self.sampling,
        )
        width = span.stop - span.start
        return tuple(x[:width] for x in jax.device_get((ids, old, behavior, ended)))

    def _lane_room(self, slot: int) -> tuple[int, int]:
        span = self._lane_slots[slot // (self.slots // self.lanes)]
        return (sum(entry is None for entry in self._active[span]), -slot)

    def _drop_cancelled(self) -> list[Finished]:
        finished = []
        if not self._cancelled:
            return finished
        kept = deque()
        for item in self._queue:
            if item[0] in self._cancelled:
                self._cancelled.discard(item[0])
                finished.append(Finished(item[0], [], [], [], "cancelled"))
            else:
                kept.append(item)
        self._queue = kept
        for slot, entry in enumerate(self._active):
            if entry is not None and entry.request in self._cancelled:
                self._cancelled.discard(entry.request)
                finished.append(self._leave(slot, "cancelled"))
        return finished

    def _leave(self, slot: int, reason: str) -> Finished:
        entry = self._active[slot]
        self._active[slot] = None
        return Finished(entry.request, entry.ids, entry.old, entry.behavior, reason)

    def _admit(self) -> None:
        free = [slot for slot, entry in enumerate(self._active) if entry is None]
        joining = []
        while free and self._queue:
            slot = max(free, key=self._lane_room)  # balance the lanes: the free slot of the emptiest lane
            free.remove(slot)
            number, ids, budget, seed = self._queue.popleft()
            self._active[slot] = _Active(number, budget)
            self._keys[slot] = jax.random.key_data(jax.random.key(seed))
            self._steps[slot] = 0
            self._budgets[slot] = budget
            joining.append((slot, ids))
        if not joining:
            return
        width = min(bucket(max(len(ids) for _, ids in joining)), self.capacity)
        tokens = np.zeros((self.slots, width), np.int32)
        lengths = np.zeros(self.slots, np.int32)
        mask = np.zeros(self.slots, bool)
        for slot, ids in joining:
            tokens[slot, : len(ids)] = ids
            lengths[slot] = len(ids)
            mask[slot] = True
        for lane, span in enumerate(self._lane_slots):
            if mask[span].any():
                self._caches[lane], self._lasts[lane] = _prefill(
                    self.model, self.variables, self._caches[lane], self._lasts[lane], _rows(tokens[span], self._rows),
                    _rows(lengths[span], self._rows), _rows(mask[span], self._rows),
                )
