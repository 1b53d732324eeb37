"""``EpisodeRollout``: multi-turn tool episodes as the Trainer's rollout for GRPOObjective.

Each call receives a batch of integer ``task_id`` rows [B], the Trainer's variables, its
committed update clock (``version``, each action's ``policy_step``), a key and, from the
Trainer, ``step=`` (the attempted-work clock). Collection binds the policy once
(``policy.bind(variables)``: a :class:`~dew.inference.TextGeneration` or anything with the
same call) and runs ``groups`` episodes of every task together, round by round:

- the factory receives each episode's :class:`~dew.records.episode_protocol.EpisodeId` (task,
  attempted step, sample, a seed from the key) and returns an Environment, entered as a
  context manager; ``reset()`` gives the first context;
- every round samples all B * G slots in one call, at their fixed row positions: a slot
  whose episode ended holds an inert one-id prompt whose output is thrown away, so turn
  counts never change which random stream a row draws from (row r of round k draws with
  ``fold_in(fold_in(key, k), r)``, as TextGeneration folds rows);
- each turn follows :class:`~dew.collection.episode_driver.EpisodeDriver`'s rules, as
  EnvironmentSource's do: a response that spends ``max_new_tokens`` without EOS is recorded
  with a "truncated" observation and never reaches a tool; otherwise ``step(action)`` gives
  the next observation. A context longer than ``max_prompt_tokens`` truncates the episode
  before the call (what was recorded stays whole), and ``max_turns`` bounds the model calls;
- ``verifier(episode)`` runs on every completed or environment-truncated episode while its
  environment is still open and must return a finite number; then each environment is
  released, and an episode whose release fails is thrown out (not trained, not in the
  baseline).

A raised exception (opening, reset, step, the policy or the verifier), an ERROR observation
or a non-finite reward raises :class:`EpisodeFailure`, and a cancellation (asyncio's or
concurrent.futures') or a CANCELLED observation :class:`EpisodeCancelled`, before any
update: both carry the partial episode, every environment exits under the original
exception first, and the original is the ``__cause__``. ``record`` receives each host
:class:`~dew.records.episode_records.EpisodeRecord`, completed or failed.

The batch is ``pack`` of :func:`~dew.records.episode_records.session_of` of every episode
(group = the task's row), ``truncation="mask"``: truncated episodes train on nothing and
stay out of the baseline; rows are ``max_prompt_tokens + max_new_tokens`` ids wide
(``GRPOObjective(seq_len=width - 1)``) and ``B * G * max_turns`` deep, which always fits.
Raw likelihoods land in ``old_log_probs``, behaviour ones in ``behavior_log_probs``.

On several JAX processes every rank collects its own task rows and the ranks meet (a
collective exchange) before opening any environment, to agree on the row count, budgets,
sampling, clocks and key, and after every phase (opening, each round, verification), so a
failure on one rank raises on all of them before the next generation and every rank
releases what it opened. Sampling is local: the policy binds a host copy of the variables,
and each local device's block of slots is one call whose key is folded with the block's
global index, so one process holding two devices draws, packs and trains exactly what two
processes of one device each do.

With ``journal=EpisodeJournal(directory)`` every draw, turn, snapshot and reward is
committed as it happens, and a run restarted from its checkpoint resumes the collection
it was in (see :mod:`dew.collection.journal`); environments must then implement
``get_state`` / ``set_state``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import sys
from collections.abc import Callable

import jax
import numpy as np

from dew.collection.episode_driver import EpisodeDriver
from dew.collection.journal import EpisodeJournal, policy_digest
from dew.losses.advantages import ESTIMATORS
from dew.records.actions import check_action
from dew.records.episode_records import ActionRecord, EpisodeRecord, session_of
from dew.records.episode_protocol import Action, Environment, Episode, EpisodeId, EpisodeStatus, Observation, Transition
from dew.records.session_packing import pack
from dew.sampling import Sampling
from dew.sharding import collective_host, describe_error, exchange, raise_failures
from dew.validation import integer, one_of

CANCELLATIONS = (asyncio.CancelledError, concurrent.futures.CancelledError)
INERT = (0,)  # the prompt a finished slot holds so that every round keeps B * G rows


class EpisodeFailure(RuntimeError):
    """An episode failed (an exception, an ERROR observation, a verifier failure); the group was not trained.

    ``episode``: the failing episode's partial host record (None when the failure was not one episode's);
    ``records``: every episode's partial record.
    """

    status = EpisodeStatus.ERROR

    def __init__(self, message: str, episode: EpisodeRecord | None, records: list[EpisodeRecord]):
        super().__init__(message)
        self.episode, self.records = episode, records


class EpisodeCancelled(EpisodeFailure):
    """Collection was cancelled; ``status`` is CANCELLED and ``__cause__`` the original cancellation, if any."""

    status = EpisodeStatus.CANCELLED


@dataclasses.dataclass(frozen=True, eq=False)
class Binding:
    """One collection's binding of the policy (compared by identity) and the layout its records pack into:
    this process's first global task row, the task rows of each local device's block and those blocks' global
    indices."""

    version: int
    first_group: int
    tasks_per_block: int
    blocks: tuple[int, ...]


@dataclasses.dataclass
class _Slot:
    row: int  # the slot's position in this process's rows (task row * groups + sample)
    identity: EpisodeId
    manager: object = None  # what the factory returned (its __exit__ releases)
    env: Environment | None = None
    record: EpisodeRecord | None = None

    @property
    def running(self) -> bool:
        return self.record is not None and not self.record.truncated and not self.record.episode.last.terminal


class _Stop(Exception):
    """An environment reported a terminal failure (ERROR or CANCELLED) for one slot."""

    def __init__(self, slot: _Slot, status: EpisodeStatus, detail: str):
        super().__init__(detail)
        self.slot, self.status, self.detail = slot, status, detail


class EpisodeRollout:
    """Tool episodes for the Trainer (see the module docstring)."""

    takes_step = True  # the Trainer passes step=, the attempted-work clock of the episode identities

    def __init__(
        self,
        policy,
        environment_factory: Callable[[EpisodeId], Environment],
        verifier: Callable[[Episode], float],
        *,
        max_prompt_tokens: int,
        max_new_tokens: int,
        max_turns: int,
        groups: int,
        sampling: Sampling | None = None,
        journal: EpisodeJournal | None = None,
        record: Callable[[EpisodeRecord], object] | None = None,
        estimator: str = "group",
    ):
        if not callable(getattr(policy, "bind", None)):
            raise TypeError(f"policy must be bindable to the Trainer's variables, as TextGeneration(model, variables) "
                            f"is, and report raw and behaviour likelihoods; got {type(policy).__name__} (canvas "
                            "generation has no per-token likelihoods)")
        if not callable(environment_factory):
            raise TypeError(f"environment_factory must be callable as factory(EpisodeId), got {environment_factory!r}")
        if not callable(verifier):
            raise TypeError(f"verifier must be callable as verifier(episode), got {verifier!r}")
        if record is not None and not callable(record):
            raise TypeError(f"record must be callable on an EpisodeRecord, got {record!r}")
        if journal is not None and not isinstance(journal, EpisodeJournal):
            raise TypeError(f"journal must be an EpisodeJournal or None, got {type(journal).__name__}")
        self.journal = journal
        self.driver = EpisodeDriver(max_prompt_tokens, max_new_tokens, max_turns)
        self.groups = integer("groups", groups, at_least=2, why="advantages compare episodes of one task")
        self.sampling = Sampling() if sampling is None else sampling
        if not isinstance(self.sampling, Sampling):
            raise TypeError(f"sampling must be a dew.sampling.Sampling, got {type(self.sampling).__name__}")
        self.estimator = one_of("estimator", estimator, ESTIMATORS)
        self.policy, self.factory, self.verifier, self.record = policy, environment_factory, verifier, record
        self.width = max_prompt_tokens + max_new_tokens
        self.metrics: dict[str, float] = {}

    @property
    def options(self) -> dict:
        """What every rank's rollout must share."""
        driver = self.driver
        return {"max_prompt_tokens": driver.max_prompt_tokens, "max_new_tokens": driver.max_new_tokens,
                "max_turns": driver.max_turns, "groups": self.groups, "sampling": repr(self.sampling),
                "estimator": self.estimator}

    # ----- the Trainer's hook --------------------------------------------------------------------

    def __call__(self, batch, variables, version: int, key: jax.Array, step: int | None = None
                 ) -> dict[str, np.ndarray] | None:
        records, binding, _ = self._collect(batch, variables, version, key, step)
        return self._project(records, binding)

    def collect(self, batch, variables, version: int, key: jax.Array, step: int | None = None
                ) -> list[EpisodeRecord]:
        """Run every episode of this process's task rows under one binding of ``variables``; the records in
        (task row, sample) order, thrown-out episodes left out. ``version`` is the committed update clock (each
        action's ``policy_step``), ``step`` the attempted-work clock of the identities (default: ``version``)."""
        return self._collect(batch, variables, version, key, step)[0]

    def gather(self, batch, variables, version: int, key: jax.Array, step: int | None = None
               ) -> tuple[list[EpisodeRecord], dict[str, np.ndarray] | None, object]:
        """``collect`` and its projection at once, for a rollout that adds targets: (records, batch or None, the
        host copy of ``variables`` the policy was bound to, which that rollout reads instead of gathering again)."""
        records, binding, host = self._collect(batch, variables, version, key, step)
        return records, self._project(records, binding), host

    def project(self, records: list[EpisodeRecord]) -> dict[str, np.ndarray] | None:
        """The packed GRPO batch of one collection's records (this process's rows); None when no rank has a
        trainable episode. Records of separately bound collections are refused."""
        if not records:
            raise ValueError("project needs the records of a collection; there are none")
        return self._project(records, records[0].origin)

    def _collect(self, batch, variables, version: int, key: jax.Array, step: int | None
                 ) -> tuple[list[EpisodeRecord], Binding, object]:
        tasks = _task_ids(batch)
        version = integer("version", version, at_least=0)
        attempted = version if step is None else integer("step", step, at_least=version)
        devices = jax.local_device_count()
        if len(tasks) % devices:
            raise ValueError(f"{len(tasks)} task rows do not split over this process's {devices} devices")
        self._meet_cohort(len(tasks), (version, attempted), key)
        host = collective_host(variables)
        policy = self.policy.bind(host)  # sampling is local: a host copy, bound once
        if self.journal is not None:
            self.journal.begin({
                "tasks": tasks, "options": self.options, "clock": [version, attempted],
                "key": np.asarray(jax.random.key_data(key)).tolist(), "policy": policy_digest(host),
                "topology": {"processes": jax.process_count(), "process": jax.process_index(), "devices": devices},
            })
        first = jax.process_index() * len(tasks)
        binding = Binding(version, first, len(tasks) // devices,
                          tuple(jax.process_index() * devices + block for block in range(devices)))
        everyone = jax.process_count() * len(tasks) * self.groups
        seeds = np.asarray(jax.random.randint(jax.random.fold_in(key, 0), (everyone,), 0, 2**31 - 1))
        slots = [_Slot(row * self.groups + sample,
                       EpisodeId(task, attempted, sample, int(seeds[(first + row) * self.groups + sample])))
                 for row, task in enumerate(tasks) for sample in range(self.groups)]
        current: list[_Slot | None] = [None]
        try:
            self._phase("opening the environments", lambda: self._open(slots, binding, current))
            turn = 0  # rounds until no rank runs an episode: the driver's limits end each one by max_turns + 1
            while self._phase(f"round {turn + 1} of the episodes", lambda: self._round(
                    slots, policy, binding, turn, jax.random.fold_in(key, turn + 1), current), running=True):
                turn += 1
            self._phase("verifying the episodes", lambda: self._verify(slots, current))
        except BaseException as error:
            _release_all(slots, sys.exc_info())
            failed = current[0].record if current[0] is not None else None
            partial = [s.record for s in slots if s.record is not None]
            self._report(partial)
            raise _wrapped(error, failed, partial) from (None if isinstance(error, _Stop) else error)
        records = []
        for slot in slots:
            try:
                slot.manager.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - a release that fails throws the episode out, it is never scored
                continue
            records.append(slot.record)
        if self.journal is not None:
            self.journal.finish()
        self._report(records)
        return records, binding, host

    # ----- the phases: each ends in a meeting of every rank ----------------------------------------

    def _meet_cohort(self, rows: int, clocks: tuple[int, int], key: jax.Array) -> None:
        """Every rank has as many task rows and the same options, clocks and key, before any environment opens."""
        if jax.process_count() == 1:
            return
        mine = {"rows": rows, "options": self.options, "clocks": list(clocks),
                "key": np.asarray(jax.random.key_data(key)).tolist()}
        everyone = exchange(mine)
        for process, theirs in enumerate(everyone):
            for name in mine:
                if theirs[name] != mine[name]:
                    raise ValueError(f"the episode cohort differs across processes: {name} is {mine[name]!r} on "
                                     f"process {jax.process_index()} and {theirs[name]!r} on process {process}; "
                                     "every rank must collect alike")

    def _phase(self, what: str, run: Callable[[], bool | None], running: bool = False):
        """Run one phase here, then meet: a failure on any rank raises on every rank; returns whether any rank
        still has a running episode (``running``) or the phase's own result."""
        error, result = None, None
        try:
            result = run()
        except BaseException as caught:  # told to every rank first
            error = caught
        if jax.process_count() == 1:
            if error is not None:
                raise error
            return result
        everyone = exchange({"error": describe_error(error), "running": bool(result) if running else False})
        raise_failures(everyone, error, what)
        return any(theirs["running"] for theirs in everyone) if running else result

    def _open(self, slots: list[_Slot], binding: Binding, current) -> None:
        journal = self.journal
        for slot in slots:
            current[0] = slot
            slot.manager = self.factory(slot.identity)
            slot.env = slot.manager.__enter__()
            if journal is not None and slot.row in journal.resets:  # restored, not reset a second time
                observation, snapshot = journal.resets[slot.row]
                _restore(slot, snapshot)
            else:
                observation = self.driver.observed(slot.env.reset(), slot.identity)
                if journal is not None:
                    journal.reset(slot.row, observation, _snapshot(slot))
            slot.record = EpisodeRecord(Episode(slot.identity, observation), [], origin=binding,
                                        group=binding.first_group + slot.row // self.groups)
            _stop_on_failure(slot, slot.record.episode.last)

    def _round(self, slots: list[_Slot], policy, binding: Binding, turn: int, key: jax.Array, current) -> bool:
        """One sampling round: each local block of slots in one policy call (or its journaled draws); True while an
        episode here runs."""
        for slot in slots:
            if slot.running:
                slot.record.truncated = self.driver.limit(slot.record.episode, len(slot.record.actions)) or ""
        size = binding.tasks_per_block * self.groups
        journal = self.journal
        for block, global_block in enumerate(binding.blocks):
            members = [slot for slot in slots[block * size:(block + 1) * size] if slot.running]
            if not members:
                continue
            recorded = [None if journal is None else journal.turns.get(slot.row, {}).get(turn) for slot in members]
            if all(entry is not None for entry in recorded):  # this block's draws survived a crash: reused
                draws = [entry.action for entry in recorded]
            else:
                draws = self._draw(slots[block * size:(block + 1) * size], members, policy,
                                   jax.random.fold_in(key, global_block), binding.version, current)
                if journal is not None:
                    journal.pending(turn, {slot.row: draw for slot, draw in zip(members, draws)})
                recorded = [None] * len(members)
            for slot, draw, entry in zip(members, draws, recorded):
                current[0] = slot
                self._act(slot, draw, turn, entry)
        return any(slot.running for slot in slots)

    def _draw(self, block: list[_Slot], members: list[_Slot], policy, key: jax.Array, version: int, current
              ) -> list[ActionRecord]:
        """One policy call over the block's rows (inert prompts where an episode ended); the live slots' draws."""
        live = {id(slot) for slot in members}
        contexts = [slot.record.episode.last.context if id(slot) in live else INERT for slot in block]
        generation = jax.device_get(policy(contexts, self.driver.max_new_tokens, key, self.sampling))
        draws = []
        for row, slot in enumerate(block):
            if id(slot) in live:
                current[0] = slot  # a refused draw names its own episode
                count = int(generation.lengths[row])
                tokens, eos = generation.ids[row, :count].tolist(), bool(generation.eos[row])
                old = generation.old_log_probs[row, :count].tolist()
                behavior = generation.behavior_log_probs[row, :count].tolist()
                # the validator of every action: ids, aligned finite likelihoods, EOS only last and as flagged
                check_action(f"the policy's draw for {slot.identity}", slot.record.episode.last.context, tokens,
                             behavior, old, eos=eos, eos_ids=self.sampling.eos_ids)
                action = Action(slot.record.episode.last.context, tuple(tokens), eos, policy_step=version)
                draws.append(ActionRecord(action, old, behavior))
        return draws

    def _act(self, slot: _Slot, draw: ActionRecord, turn: int, recorded) -> None:
        """The draw's turn: replayed from the journal when it completed before a crash, else sent to the tool."""
        action = draw.action
        slot.record.actions.append(draw)
        if recorded is not None and recorded.observation is not None:
            observation = recorded.observation
            if recorded.snapshot is not None:
                _restore(slot, recorded.snapshot)
        else:
            observation = self.driver.act(slot.env, action, slot.identity)
            snapshot = _snapshot(slot) if self.journal is not None and action.eos else None
            if self.journal is not None:
                self.journal.complete(slot.row, turn, observation, snapshot)
        slot.record.episode.transitions.append(Transition(action, observation))
        _stop_on_failure(slot, observation)

    def _verify(self, slots: list[_Slot], current) -> None:
        """The verifier on every completed or environment-truncated episode, its environment still open."""
        for slot in slots:
            current[0] = slot
            episode = slot.record.episode
            if self.driver.verifiable(episode) and not slot.record.truncated:
                if self.journal is not None and slot.row in self.journal.rewards:
                    slot.record.reward = self.journal.rewards[slot.row]  # verified before a crash
                    continue
                slot.record.reward = self.driver.reward(self.verifier(episode), slot.record.describe())
                if self.journal is not None:
                    self.journal.reward(slot.row, slot.record.reward)

    def _report(self, records: list[EpisodeRecord]) -> None:
        if self.record is not None:
            for record in records:
                self.record(record)

    # ----- projection ----------------------------------------------------------------------------

    def _project(self, records: list[EpisodeRecord], binding: Binding) -> dict[str, np.ndarray] | None:
        strangers = [r for r in records if r.origin is not binding]
        if strangers:
            raise ValueError(f"{len(strangers)} of these {len(records)} episode records come from a separately bound "
                             "collection; project each collection's records on their own")
        rows = binding.tasks_per_block * self.groups * self.driver.max_turns  # B * G * K per block: always fits
        blocks = []
        for block in range(len(binding.blocks)):
            low = binding.first_group + block * binding.tasks_per_block
            mine = [r for r in records if low <= r.group < low + binding.tasks_per_block]
            sessions = [session_of(r) for r in mine]
            packed = pack(sessions, self.width, rows=rows, estimator=self.estimator, truncation="mask")
            # every episode records raw likelihoods; a block with nothing trainable still carries the field
            packed.setdefault("old_log_probs", np.zeros_like(packed["behavior_log_probs"]))
            # session_index names the episode's global slot, so sessions of different blocks never collide
            slot_of = np.array([r.group * self.groups + r.episode.id.sample for r in mine] or [0], np.int32)
            index = packed["session_index"]
            packed["session_index"] = np.where(index >= 0, slot_of[np.maximum(index, 0)], -1).astype(np.int32)
            blocks.append(packed)
        batch = {name: np.concatenate([b[name] for b in blocks]) for name in blocks[0]}
        self.metrics = _metrics(records)
        trainable = bool((batch["response_mask"] != 0).any())
        if jax.process_count() > 1:
            trainable = any(theirs["trainable"] for theirs in exchange({"trainable": trainable}))
        return batch if trainable else None


def _metrics(records: list[EpisodeRecord]) -> dict[str, float]:
    rewards = [r.reward for r in records if r.reward is not None and r.status is EpisodeStatus.COMPLETED]
    return {
        "reward/mean": float(np.mean(rewards)) if rewards else float("nan"),
        "episode/turns": float(np.mean([len(r.actions) for r in records])) if records else 0.0,
        "episode/truncated_share": float(np.mean([r.status is EpisodeStatus.TRUNCATED for r in records]))
        if records else 0.0,
    }


def _task_ids(batch) -> list[int]:
    if "task_id" not in batch:
        raise KeyError(f"EpisodeRollout needs integer 'task_id' rows; the batch has {sorted(batch)}")
    ids = np.asarray(batch["task_id"])
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or (ids < 0).any():
        raise ValueError(f"task_id must be a [rows] array of non-negative integers, got shape {ids.shape} "
                         f"dtype {ids.dtype}")
    return [int(i) for i in ids]


def _snapshot(slot: _Slot) -> bytes:
    """The environment's state for the journal; an environment without snapshots cannot be journaled."""
    try:
        state = slot.env.get_state()
    except NotImplementedError as error:
        raise TypeError(f"an EpisodeJournal needs environments that snapshot their state: {error}") from None
    if not isinstance(state, bytes):
        raise TypeError(f"the environment of {slot.identity} returned {type(state).__name__} from get_state(), "
                        "not bytes")
    return state


def _restore(slot: _Slot, snapshot: bytes) -> None:
    try:
        slot.env.set_state(snapshot)
    except NotImplementedError as error:
        raise TypeError(f"an EpisodeJournal needs environments that restore their state: {error}") from None


def _stop_on_failure(slot: _Slot, observation: Observation) -> None:
    if observation.status in (EpisodeStatus.ERROR, EpisodeStatus.CANCELLED):
        raise _Stop(slot, observation.status, observation.detail)


def _release_all(slots: list[_Slot], exc_info) -> None:
    """Every opened environment exits under the original exception; their own errors cannot replace it."""
    for slot in slots:
        if slot.manager is not None and slot.env is not None:
            try:
                slot.manager.__exit__(*exc_info)
            except BaseException:  # noqa: BLE001 - the original failure is the one to report
                pass


def _wrapped(error: BaseException, failed: EpisodeRecord | None, partial: list[EpisodeRecord]) -> EpisodeFailure:
    if isinstance(error, _Stop):
        kind = EpisodeCancelled if error.status is EpisodeStatus.CANCELLED else EpisodeFailure
        where = error.slot.record.describe() if error.slot.record is not None else str(error.slot.identity)
        return kind(f"{where} ended {error.status.value}: {error.detail}", error.slot.record, partial)
    where = failed.describe() if failed is not None else "collection"
    if isinstance(error, CANCELLATIONS):
        return EpisodeCancelled(f"{where} was cancelled ({type(error).__name__})", failed, partial)
    return EpisodeFailure(f"{where} failed: {error!r}; the group was not trained", failed, partial)
