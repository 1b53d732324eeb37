"""Continuous batching: ``Server`` keeps a fixed number of cache slots busy.

A request (context ids, a response budget, a seed) waits in a queue until a slot is
free, joins between two decode steps (its context is prefilled into its slot's cache
row), then gets one token per step until it samples EOS, spends its budget or is
cancelled, and leaves; its slot takes the next request at the following step. Every
step is one compiled call over all slots: sampling is fused into it and the weights
are read once per step for every active request. Contexts that join at the same step
are prefilled packed into one row of ids (at most ``PACKED_IDS`` per call, each attending
only to itself), so a prefill costs the joining ids alone: neither padding to the
longest context nor the slots that are decoding (a lone request joining 31 busy slots
used to cost a 32-row forward pass).

Request randomness depends only on its seed: token ``t`` draws with
``fold_in(key(seed), t)``, so a request samples the same tokens alone or beside others.
``reload(variables)`` swaps in new weights between two steps, cast to the served dtype
(train in float32, serve in bfloat16). Serving in bfloat16 also runs the decoder's
weight products on bfloat16 operands with float32 accumulation (``matmul_dtype``),
which CPUs with AVX512-BF16 run about twice as fast as float32 products; norms, rotary,
attention and sampling stay in float32. ``Server.from_task(task, slots=, capacity=)``
builds one from a :class:`ServingTask`.

Each slot's cache is split into blocks along its positions (``block_size`` positions
first, then each block as large as all before it), and a decode step reads, attends
over and writes only the blocks up to the furthest position its requests reach, so a
step costs about what the requests use rather than the capacity: with capacity 1024,
bench/serve_throughput.py's requests (at most 176 positions) decoded 1.5 times (32
requests, two lanes) and 1.6 times (8 requests) as fast as over the whole capacity.
The step compiles once per number of blocks.

Steps are pipelined: ``step()`` starts the next decode step on the device before it
reads its own step's tokens, so the device does not wait while the host dispatches a
step (about 0.6 ms of host time, a sixth of a one-request step) and hands out tokens.
What a step reads besides the cache (lengths, the logits to sample from, keys, token
counts, budgets, whether a slot still decodes) stays on the device from step to step.
The step started ahead draws for the slots occupied when it started: a request
cancelled meanwhile leaves without that token, a request admitted meanwhile gets its
first token one ``step()`` later, and a ``reload`` starts it again on the new weights,
so weights still change exactly between two steps.

``batch_invariant=True`` makes a request's numbers independent of the other requests: a
packed prefill's width (a power of two over every id joining at that step) changes the last
bits of each of its prompts' logits, so every prompt is then prefilled alone; and the cache
is one block, so every decode step is one compiled program (the step at which another request
first reached a further block gave the request other last bits in its log-probability). A
decode step computes every row of its lane whoever occupies them, and the float32 attention
reads each row only up to its own length (tests/test_server_invariance.py compares requests
alone and beside others bit for bit). It costs prefill calls (prompts that join together no
longer share one) and, in bfloat16, whose attention reads every position of the blocks, the
reads of the whole capacity.

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
from flax import struct

from dew.inference.generation import bucket, sample_controlled_rows, sample_rows
from dew.models import native_product
from dew.models.transformer import KVCache, init_cache
from dew.sampling import Sampling, controls
from dew.validation import integer, positive_int

PACKED_IDS = 256  # prompt ids per packed prefill call (a longer prompt is prefilled alone)
BLOCK_SIZE = 64  # positions of a cache's first block (see cache_blocks)


@dataclasses.dataclass(frozen=True)
class ServingTask:
    """What serving needs: the decoder, its variables, the Sampling (with EOS ids) and the served dtype."""

    model: Any
    variables: Any
    sampling: Sampling
    dtype: Any = jnp.float32
    batch_invariant: bool = False  # Server(batch_invariant=...): each prompt prefilled alone


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
    context: int  # prompt ids in the cache
    sampling: Sampling | None = None  # the request's own, when it is not the served one
    prompt: bytes = b""  # its prompt ids (int32 bytes): a request with the same prompt copies its cache rows
    weights: int = 0  # the Server's reload count when its prompt was prefilled
    launched: int = 0  # decode steps started for it: the next one writes cache position context + launched
    ids: list = dataclasses.field(default_factory=list)
    old: list = dataclasses.field(default_factory=list)
    behavior: list = dataclasses.field(default_factory=list)


def cast_floating(variables, dtype):
    """Floating leaves in ``dtype``, others as they are."""

    def cast(leaf):
        leaf = jnp.asarray(leaf)
        return leaf.astype(dtype) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf

    return jax.tree.map(cast, variables)


@struct.dataclass
class _Slots:
    """What a lane's decode step reads besides the cache's keys and values, one row per slot.

    Kept on the device and carried from step to step, so a step starts without the host:
    lengths (the cache's valid positions), last (the logits the next draw samples from),
    keys (each request's key data), steps (tokens drawn so far), budgets, alive
    (still decoding: it has not sampled EOS nor spent its budget) and controls (each
    request's Sampling as ``dew.sampling.controls``, read by steps that mix Samplings) and
    first (the logits after the request's prompt, which a request with the same prompt starts from).
    """

    lengths: jax.Array
    last: jax.Array
    first: jax.Array
    keys: jax.Array
    steps: jax.Array
    budgets: jax.Array
    alive: jax.Array
    controls: jax.Array


@partial(jax.jit, static_argnames=("model",), donate_argnames=("kv",))
def _prefill(model, variables, kv, slots: _Slots, pack: "_Pack"):
    cache = KVCache(*kv, jnp.where(pack.joining, 0, slots.lengths))
    logits, cache = model.apply(variables, pack.tokens, segment_ids=pack.segments, positions=pack.positions,
                                cache=cache, rows=pack.rows, logits_at=pack.last[None])
    joining = pack.joining
    return (cache.keys, cache.values), _Slots(
        lengths=cache.lengths,
        last=jnp.where(joining[:, None], logits[0], slots.last),
        first=jnp.where(joining[:, None], logits[0], slots.first),
        keys=jnp.where(joining[:, None], pack.keys, slots.keys),
        steps=jnp.where(joining, 0, slots.steps),
        budgets=jnp.where(joining, pack.budgets, slots.budgets),
        alive=slots.alive | joining,
        controls=jnp.where(joining[:, None], pack.controls, slots.controls),
    )


@partial(jax.jit, static_argnames=("model", "sampling", "mixed"), donate_argnames=("kv",))
def _decode(model, variables, kv, slots: _Slots, keep, sampling: Sampling, mixed: bool = False):
    """One token for every alive slot the host still ``keep``s; returns the new state and what the host reads.

    ``mixed``: some request has its own Sampling, so every row draws under its slot's controls.
    """
    alive = slots.alive & keep
    keys = jax.random.wrap_key_data(slots.keys)
    drawn = (sample_controlled_rows(slots.last, keys, slots.steps, slots.controls) if mixed
             else sample_rows(slots.last, keys, slots.steps, sampling))
    eos_ids = jnp.asarray(sampling.eos_ids or (-1,), jnp.int32)
    ended = alive & jnp.isin(drawn.ids, eos_ids)
    feed = alive & ~ended & (slots.steps + 1 < slots.budgets)
    logits, cache = model.apply(variables, drawn.ids[:, None], cache=KVCache(*kv, slots.lengths),
                                lengths=feed.astype(jnp.int32))
    after = _Slots(
        lengths=cache.lengths,
        last=jnp.where(feed[:, None], logits[:, 0], slots.last),
        first=slots.first,
        keys=slots.keys,
        steps=slots.steps + alive,
        budgets=slots.budgets,
        alive=feed,
        controls=slots.controls,
    )
    return (cache.keys, cache.values), after, (drawn.ids, drawn.old_log_probs, drawn.behavior_log_probs, ended, alive)


@partial(jax.jit, static_argnames=("blocks",), donate_argnames=("kv",))
def _share(kv, slots: _Slots, copies: "_Copies", blocks: int):
    """Start requests from the prompt another row of the lane already holds: its first ``blocks`` cache blocks
    (the prompt's positions) copied into theirs, and its logits after the prompt (see :meth:`Server._admit`)."""
    sources, targets = copies.sources, copies.targets

    def copied(layer):
        return tuple(block.at[targets].set(block[sources], mode="drop") if index < blocks else block
                     for index, block in enumerate(layer))

    keys, values = kv
    first = slots.first[sources]
    return (tuple(copied(layer) for layer in keys), tuple(copied(layer) for layer in values)), _Slots(
        lengths=slots.lengths.at[targets].set(copies.lengths, mode="drop"),
        last=slots.last.at[targets].set(first, mode="drop"),
        first=slots.first.at[targets].set(first, mode="drop"),
        keys=slots.keys.at[targets].set(copies.keys, mode="drop"),
        steps=slots.steps.at[targets].set(0, mode="drop"),
        budgets=slots.budgets.at[targets].set(copies.budgets, mode="drop"),
        alive=slots.alive.at[targets].set(True, mode="drop"),
        controls=slots.controls.at[targets].set(copies.controls, mode="drop"),
    )


@struct.dataclass
class _Copies:
    """Requests that start from a prompt another lane row holds: sources and targets (lane rows; padding
    targets point past the rows and are dropped), and each target's prompt length, key, budget and controls."""

    sources: jax.Array
    targets: jax.Array
    lengths: jax.Array
    keys: jax.Array
    budgets: jax.Array
    controls: jax.Array


@dataclasses.dataclass
class _Launched:
    """A lane's decode step started on the device: who held each of its slots then, its outputs for the
    host, and the lane's state before it (to start it again after a reload)."""

    lane: int
    owners: list
    out: tuple
    before: _Slots


@struct.dataclass
class _Pack:
    """Prompts joining one lane, packed into a single row of ids (see :meth:`Server._packs`).

    tokens, segments (1, 2, ... per prompt, 0 for padding), positions (within each prompt)
    and rows (the lane row each id is written to): [1, width]. Per lane row: joining,
    last (the index in the pack of the row's last prompt id), keys, budgets and controls.
    """

    tokens: jax.Array
    segments: jax.Array
    positions: jax.Array
    rows: jax.Array
    joining: jax.Array
    last: jax.Array
    keys: jax.Array
    budgets: jax.Array
    controls: jax.Array


def cache_blocks(capacity: int, first: int) -> list[int]:
    """Block sizes for a cache of ``capacity`` positions: ``first``, then each as large as all before it.

    A decode step reads the blocks up to the furthest position its requests reach, so it
    reads at most about twice the positions they use, and a Server compiles its step once
    per window: a number of windows that grows with the logarithm of the capacity.
    """
    sizes = [min(first, capacity)]
    while sum(sizes) < capacity:
        sizes.append(min(sum(sizes), capacity - sum(sizes)))
    return sizes


def blocks_reaching(ends: np.ndarray, positions: int) -> int:
    """How many of the blocks ending at ``ends`` hold the first ``positions`` positions (at most all of them)."""
    return min(int(np.searchsorted(ends, positions)) + 1, len(ends))


def _rows(values: np.ndarray, rows: int) -> jax.Array:
    """``values`` with inert zero rows appended up to ``rows``."""
    padding = [(0, rows - len(values))] + [(0, 0)] * (values.ndim - 1)
    return jnp.asarray(np.pad(values, padding))


class Server:
    """A fixed number of ``slots``, each a cache row of ``capacity`` positions (see the module docstring)."""

    def __init__(
        self, model, variables, sampling: Sampling, slots: int, capacity: int, dtype=jnp.float32, lanes: int = 1,
        block_size: int = BLOCK_SIZE, batch_invariant: bool = False,
    ):
        positive_int("slots", slots)
        integer("capacity", capacity, at_least=2)
        if positive_int("lanes", lanes, why=f"one that divides slots={slots}") and slots % lanes:
            raise ValueError(f"lanes must be a positive integer that divides slots={slots}, got {lanes!r}")
        positive_int("block_size", block_size)
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a dew.sampling.Sampling, got {type(sampling).__name__}")
        if jnp.dtype(dtype) != jnp.float32 and getattr(model, "matmul_dtype", jnp.float32) is None:
            model = model.clone(matmul_dtype=dtype)  # serve in the served precision: products on its operands
        if batch_invariant and hasattr(model, "kernel_rows"):  # dew's kernel computes each row alone
            model = model.clone(kernel_rows=native_product.INVARIANT_ROWS)
        self.model, self.sampling, self.slots, self.capacity, self.dtype = model, sampling, slots, capacity, dtype
        self.lanes, self.batch_invariant = lanes, bool(batch_invariant)
        self.variables = cast_floating(variables, dtype)
        width = slots // lanes
        self._lane_slots = [slice(lane * width, (lane + 1) * width) for lane in range(lanes)]
        # A lane computes at least two rows: XLA's CPU products take a slow path for a single row
        # (with bfloat16 weights it even converts every weight to float32 each step); a spare row is nearly free.
        self._rows = max(2, width)
        rows = self._rows
        # batch_invariant: one block, so one compiled step; a step that reads one more block than the last (because
        # another request reached it) gave a request's log-probability other last bits at that step
        blocks = [capacity] if batch_invariant else cache_blocks(capacity, block_size)
        self._ends = np.cumsum(blocks)  # positions up to each block's end
        self._kv, self._slots = [], []
        for _ in range(lanes):
            cache = init_cache(model, rows, capacity, blocks=blocks)
            self._kv.append((cache.keys, cache.values))
            self._slots.append(_Slots(
                lengths=cache.lengths, last=jnp.zeros((rows, model.vocab_size), jnp.float32),
                first=jnp.zeros((rows, model.vocab_size), jnp.float32),
                keys=jnp.zeros((rows, *jax.random.key_data(jax.random.key(0)).shape), jnp.uint32),
                steps=jnp.zeros(rows, jnp.int32), budgets=jnp.zeros(rows, jnp.int32), alive=jnp.zeros(rows, bool),
                controls=jnp.tile(jnp.asarray(controls(sampling), jnp.float32), (rows, 1)),
            ))
        self._pool = ThreadPoolExecutor(lanes, thread_name_prefix="dew-lane") if lanes > 1 else None
        self._ahead: list[_Launched | None] = [None] * lanes  # each lane's next step, started before its last was read
        self._active: list[_Active | None] = [None] * slots
        self._queue: deque = deque()
        self._cancelled: set[int] = set()
        self._numbers = itertools.count()
        self._weights = 0  # reloads so far

    @classmethod
    def from_task(
        cls, task: ServingTask, slots: int, capacity: int, lanes: int = 1, block_size: int = BLOCK_SIZE
    ) -> "Server":
        return cls(task.model, task.variables, task.sampling, slots=slots, capacity=capacity, dtype=task.dtype,
                   lanes=lanes, block_size=block_size, batch_invariant=task.batch_invariant)

    # ----- requests ------------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int = 0,
               sampling: Sampling | None = None) -> int:
        """Queue a request and return its number; bad requests raise here and touch no slot.

        ``sampling``: the request's own controls (temperature, top-k, top-p, min-p); it
        shares the batch with requests of other Samplings, and its behaviour
        log-probabilities are those of its own distribution. EOS stays the served one's.
        """
        ids = np.asarray(list(prompt_ids), np.int64)
        if ids.size == 0:
            raise ValueError("the prompt is empty; a request needs at least one id")
        if ids.ndim != 1 or ids.min() < 0 or ids.max() >= self.model.vocab_size:
            raise ValueError(f"the prompt holds ids outside the vocabulary [0, {self.model.vocab_size})")
        positive_int("max_new_tokens", max_new_tokens)
        if ids.size + max_new_tokens > self.capacity:
            raise ValueError(
                f"a prompt of {ids.size} ids plus a budget of {max_new_tokens} exceeds the cache capacity {self.capacity}"
            )
        if sampling is not None:
            if not isinstance(sampling, Sampling):
                raise TypeError(f"sampling must be a dew.sampling.Sampling, got {type(sampling).__name__}")
            if sampling.eos_id is not None and sampling.eos_ids != self.sampling.eos_ids:
                raise ValueError(f"a request's Sampling keeps the served EOS ids {self.sampling.eos_ids}, "
                                 f"got {sampling.eos_ids}")
            if sampling.top_k is not None and sampling.top_k > self.model.vocab_size:
                raise ValueError(f"top_k={sampling.top_k} exceeds the vocabulary of {self.model.vocab_size} ids")
            if controls(sampling) == controls(self.sampling):
                sampling = None  # the served one: the fast step serves it
        number = next(self._numbers)
        self._queue.append((number, ids.astype(np.int32), max_new_tokens, int(seed), sampling))
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
        self._weights += 1  # prompts held under the old weights are prefilled again
        for lane, ahead in enumerate(self._ahead):  # drawn with the old weights: the next step draws it again
            if ahead is not None:
                self._slots[lane] = ahead.before
                for entry in ahead.owners:
                    if entry is not None:
                        entry.launched -= 1
        self._ahead = [None] * self.lanes

    # ----- stepping ------------------------------------------------------------------------

    def step(self) -> list[Finished]:
        """Admit waiting requests into free slots, then decode one token for every active slot.

        The step after this one starts on the device before this one's tokens reach the
        host (see the module docstring); a reload drops it, and the next call starts it again.
        """
        finished = self._drop_cancelled()
        self._admit()
        lanes = [lane for lane, span in enumerate(self._lane_slots) if any(self._active[span])]
        for lane in set(range(self.lanes)) - set(lanes):
            self._ahead[lane] = None
        if self._pool is None or len(lanes) == 1:
            return finished + [f for lane in lanes for f in self._step_lane(lane)]
        return finished + [f for done in self._pool.map(self._step_lane, lanes) for f in done]

    def _step_lane(self, lane: int) -> list[Finished]:
        current = self._ahead[lane] or self._launch(lane)
        self._ahead[lane] = self._launch(lane) if self._continues(current) else None
        return self._collect(current)

    def _launch(self, lane: int) -> _Launched:
        """Start a decode step of a lane, without waiting for it."""
        span = self._lane_slots[lane]
        owners = self._active[span]
        keep = np.array([entry is not None for entry in owners])
        held = [entry for entry in owners if entry is not None]
        # The step reads and writes only the cache blocks up to the furthest position it writes.
        blocks = blocks_reaching(self._ends, max(e.context + e.launched + 1 for e in held)) if held else 1
        for entry in held:
            entry.launched += 1
        keys, values = self._kv[lane]
        window = (tuple(layer[:blocks] for layer in keys), tuple(layer[:blocks] for layer in values))
        before = self._slots[lane]
        mixed = any(entry.sampling is not None for entry in held)
        (new_keys, new_values), self._slots[lane], out = _decode(
            self.model, self.variables, window, before, _rows(keep, self._rows), self.sampling, mixed
        )
        self._kv[lane] = (tuple(new + old[blocks:] for new, old in zip(new_keys, keys, strict=True)),
                          tuple(new + old[blocks:] for new, old in zip(new_values, values, strict=True)))
        return _Launched(lane, owners, out, before)

    def _continues(self, launched: _Launched) -> bool:
        """Whether a request of the lane will still need a token after ``launched`` (EOS aside: only the step knows)."""
        return any(
            entry is not None and len(entry.ids) + (entry is owner) < entry.budget
            for entry, owner in zip(self._active[self._lane_slots[launched.lane]], launched.owners, strict=True)
        )

    def _collect(self, launched: _Launched) -> list[Finished]:
        """Wait for ``launched`` and hand its tokens to the requests that still hold their slots."""
        finished = []
        ids, old, behavior, ended, drew = jax.device_get(launched.out)
        start = self._lane_slots[launched.lane].start
        for row in np.flatnonzero(drew):
            slot = start + row
            entry = self._active[slot]
            if entry is None or entry is not launched.owners[row]:
                continue  # cancelled while the step ran
            entry.ids.append(int(ids[row]))
            entry.old.append(float(old[row]))
            entry.behavior.append(float(behavior[row]))
            if ended[row] or len(entry.ids) >= entry.budget:
                finished.append(self._leave(slot, "stop" if ended[row] else "length"))
        return finished

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
        """Give waiting requests free slots: each prompt is prefilled once per lane.

        A request whose prompt a row of its lane already holds (a GRPO group's other
        samples, the ``n`` draws of one OpenAI request) is not prefilled: that row's
        cache blocks up to the prompt's end are copied into its row and it starts from
        the same logits, then draws with its own key. A row holds a prompt from its
        prefill (or copy) until its request leaves, under the weights it was prefilled
        with: after a ``reload`` the prompt is prefilled again.
        """
        free = [slot for slot, entry in enumerate(self._active) if entry is None]
        joining = []
        while free and self._queue:
            slot = max(free, key=self._lane_room)  # balance the lanes: the free slot of the emptiest lane
            free.remove(slot)
            number, ids, budget, seed, sampling = self._queue.popleft()
            self._active[slot] = _Active(number, budget, len(ids), sampling, ids.tobytes(), self._weights)
            joining.append((slot, ids, budget, seed, sampling))
        for lane, span in enumerate(self._lane_slots):
            entries = [entry for entry in joining if span.start <= entry[0] < span.stop]
            joining_slots = {entry[0] for entry in entries}
            holders = {entry.prompt: slot for slot, entry in enumerate(self._active[span], start=span.start)
                       if entry is not None and slot not in joining_slots and entry.weights == self._weights}
            prefilled, copies = [], []
            for entry in entries:
                prompt = self._active[entry[0]].prompt
                if prompt in holders:
                    copies.append((holders[prompt], *entry))
                else:
                    holders[prompt] = entry[0]
                    prefilled.append(entry)
            for pack in self._packs(prefilled, span.start):
                self._kv[lane], self._slots[lane] = _prefill(
                    self.model, self.variables, self._kv[lane], self._slots[lane], pack
                )
            if copies:
                self._kv[lane], self._slots[lane] = _share(
                    self._kv[lane], self._slots[lane], self._copies(copies, span.start),
                    blocks_reaching(self._ends, max(len(entry[2]) for entry in copies)),
                )

    def _draw_state(self, seed: int, sampling: Sampling | None) -> tuple[np.ndarray, tuple]:
        """A joining request's key data and its Sampling's controls, as its slot row holds them."""
        return jax.random.key_data(jax.random.key(seed)), controls(sampling or self.sampling)

    def _copies(self, copies: list, start: int) -> _Copies:
        """The requests that copy a held prompt, padded to a power of two (padding targets are dropped)."""
        size = bucket(len(copies), least=1)
        sources, targets = np.zeros(size, np.int32), np.full(size, self._rows, np.int32)
        lengths, budgets = np.zeros(size, np.int32), np.zeros(size, np.int32)
        keys = np.zeros((size, *self._slots[0].keys.shape[1:]), np.uint32)
        rules = np.tile(np.asarray(controls(self.sampling), np.float32), (size, 1))
        for index, (source, slot, ids, budget, seed, sampling) in enumerate(copies):
            sources[index], targets[index] = source - start, slot - start
            lengths[index], budgets[index] = len(ids), budget
            keys[index], rules[index] = self._draw_state(seed, sampling)
        return _Copies(*(jnp.asarray(a) for a in (sources, targets, lengths, keys, budgets, rules)))

    def _packs(self, joining: list, start: int):
        """The prompts joining a lane as packs of at most PACKED_IDS ids (a longer prompt alone).

        A pack is one row of ids: each prompt costs its own length, not the longest
        prompt's, and lane rows without a prompt cost nothing. Widths are powers of two so
        compilations repeat; the cap bounds the pack's [width, width] attention scores. With
        ``batch_invariant`` every prompt is a pack of its own.
        """
        while joining:
            count, total = 1, len(joining[0][1])
            while (not self.batch_invariant and count < len(joining)
                   and total + len(joining[count][1]) <= PACKED_IDS):
                total += len(joining[count][1])
                count += 1
            group, joining = joining[:count], joining[count:]
            width = bucket(total)
            tokens, segments, positions, rows = (np.zeros((1, width), np.int32) for _ in range(4))
            joins = np.zeros(self._rows, bool)
            last, budgets = np.zeros(self._rows, np.int32), np.zeros(self._rows, np.int32)
            keys = np.zeros((self._rows, *self._slots[0].keys.shape[1:]), np.uint32)
            rules = np.tile(np.asarray(controls(self.sampling), np.float32), (self._rows, 1))
            offset = 0
            for number, (slot, ids, budget, seed, sampling) in enumerate(group, start=1):
                row, end = slot - start, offset + len(ids)
                tokens[0, offset:end], segments[0, offset:end] = ids, number
                positions[0, offset:end], rows[0, offset:end] = np.arange(len(ids)), row
                joins[row], last[row], budgets[row] = True, end - 1, budget
                keys[row], rules[row] = self._draw_state(seed, sampling)
                offset = end
            yield _Pack(*(jnp.asarray(a) for a in (tokens, segments, positions, rows, joins, last, keys, budgets,
                                                    rules)))
