"""``EpisodeRollout``: multi-turn tool episodes as the Trainer's rollout for GRPOObjective.

Each call receives a batch of integer ``task_id`` rows [B], the Trainer's variables, its
committed update clock (``version``) and a key. Collection binds the policy once
(``policy.bind(variables)``: a :class:`~dew.inference.TextGeneration` or anything with the
same call) and runs ``groups`` episodes of every task together, round by round:

- the factory receives each episode's :class:`~dew.records.episodes.EpisodeId` (task,
  attempted step = ``version``, sample, a seed from the key) and returns an Environment,
  entered as a context manager; ``reset()`` gives the first context;
- every round samples all B * G slots in one call, at their fixed row positions: a slot
  whose episode ended holds an inert one-id prompt whose output is thrown away, so turn
  counts never change which random stream a row draws from (row r of round k draws with
  ``fold_in(fold_in(key, k), r)``, as TextGeneration folds rows);
- a response that spends ``max_new_tokens`` without EOS is recorded with a "truncated"
  observation and never reaches a tool; otherwise ``step(action)`` gives the next
  observation. A context longer than ``max_prompt_tokens`` truncates the episode before
  the call (what was recorded stays whole), and ``max_turns`` bounds the model calls;
- ``verifier(episode)`` runs on every completed or environment-truncated episode while its
  environment is still open and must return a finite number; then each environment is
  released, and an episode whose release fails is thrown out (not trained, not in the
  baseline).

A raised exception (opening, reset, step, the policy or the verifier), an ERROR observation
or a non-finite reward raises :class:`EpisodeFailure`, and a cancellation (asyncio's or
concurrent.futures') or a CANCELLED observation :class:`EpisodeCancelled`, before any
update: both carry the partial episode, every environment exits under the original
exception first, and the original is the ``__cause__``. ``record`` receives each host
:class:`~dew.records.episode_sessions.EpisodeRecord`, completed or failed.

The batch is ``pack`` of :func:`~dew.records.episode_sessions.session_of` of every episode
(group = the task's row), ``truncation="mask"``: truncated episodes train on nothing and
stay out of the baseline; rows are ``max_prompt_tokens + max_new_tokens`` ids wide
(``GRPOObjective(seq_len=width - 1)``) and ``B * G * max_turns`` deep, which always fits.
Raw likelihoods land in ``old_log_probs``, behaviour ones in ``behavior_log_probs``.

Absent so far: the multi-process cohort (ranks agreeing on budgets, clocks and failures)
is refused on more than one JAX process, and there is no EpisodeJournal yet.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import numbers
import sys
from collections.abc import Callable

import jax
import numpy as np

from dew.losses.advantages import ESTIMATORS
from dew.records.episode_sessions import ActionRecord, EpisodeRecord, session_of
from dew.records.episodes import Action, Environment, Episode, EpisodeId, EpisodeStatus, Observation, Transition
from dew.records.packing import pack
from dew.sampling import Sampling
from dew.validation import integer, one_of, positive_int

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


@dataclasses.dataclass
class _Slot:
    row: int
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
        self.max_prompt_tokens = positive_int("max_prompt_tokens", max_prompt_tokens)
        self.max_new_tokens = positive_int("max_new_tokens", max_new_tokens)
        self.max_turns = positive_int("max_turns", max_turns)
        self.groups = integer("groups", groups, at_least=2, why="advantages compare episodes of one task")
        self.sampling = Sampling() if sampling is None else sampling
        if not isinstance(self.sampling, Sampling):
            raise TypeError(f"sampling must be a dew.sampling.Sampling, got {type(self.sampling).__name__}")
        self.estimator = one_of("estimator", estimator, ESTIMATORS)
        self.policy, self.factory, self.verifier, self.record = policy, environment_factory, verifier, record
        self.width = self.max_prompt_tokens + self.max_new_tokens
        self.metrics: dict[str, float] = {}

    # ----- the Trainer's hook --------------------------------------------------------------------

    def __call__(self, batch, variables, version: int, key: jax.Array) -> dict[str, np.ndarray] | None:
        if jax.process_count() > 1:
            raise NotImplementedError("EpisodeRollout on several JAX processes (the agreeing cohort) is not built yet; "
                                      "collect on one process")
        records = self.collect(batch, variables, version, key)
        return self.project(records, rows=len(records) * self.max_turns)

    def collect(self, batch, variables, version: int, key: jax.Array) -> list[EpisodeRecord]:
        """Run every episode of the batch (one binding of ``variables``); the records in (task row, sample) order,
        thrown-out episodes left out."""
        tasks = _task_ids(batch)
        version = integer("version", version, at_least=0)
        policy = self.policy.bind(variables)
        origin = object()  # this binding's identity: project refuses records of another
        seeds = np.asarray(jax.random.randint(jax.random.fold_in(key, 0), (len(tasks) * self.groups,), 0, 2**31 - 1))
        slots = [_Slot(row * self.groups + sample, EpisodeId(task, version, sample, int(seeds[row * self.groups + sample])))
                 for row, task in enumerate(tasks) for sample in range(self.groups)]
        current: list[_Slot | None] = [None]
        try:
            for slot in slots:
                current[0] = slot
                slot.manager = self.factory(slot.identity)
                slot.env = slot.manager.__enter__()
                slot.record = EpisodeRecord(Episode(slot.identity, _observed(slot, slot.env.reset())), [],
                                            origin=origin, group=slot.row // self.groups)
                _stop_on_failure(slot, slot.record.episode.last)
            for turn in range(self.max_turns):
                if not self._round(slots, policy, version, jax.random.fold_in(key, turn + 1), current):
                    break
            for slot in slots:
                if slot.running:
                    slot.record.truncated = f"the episode needs more than max_turns={self.max_turns} model calls"
            for slot in slots:  # while the environments are open; host-truncated episodes train on nothing
                current[0] = slot
                if slot.record.episode.status in (EpisodeStatus.COMPLETED, EpisodeStatus.TRUNCATED) \
                        and not slot.record.truncated:
                    slot.record.reward = _finite(slot, self.verifier(slot.record.episode))
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
        self._report(records)
        return records

    def _round(self, slots: list[_Slot], policy, version: int, key: jax.Array, current) -> bool:
        """One sampling round over every slot; False when no episode is running."""
        for slot in slots:
            if slot.running and len(slot.record.episode.last.context) > self.max_prompt_tokens:
                slot.record.truncated = (f"a context of {len(slot.record.episode.last.context)} ids exceeds "
                                  f"max_prompt_tokens={self.max_prompt_tokens}")
        live = [slot.running for slot in slots]
        if not any(live):
            return False
        contexts = [slot.record.episode.last.context if alive else INERT for slot, alive in zip(slots, live)]
        generation = jax.device_get(policy(contexts, self.max_new_tokens, key, self.sampling))
        for slot, alive in zip(slots, live):
            if not alive:
                continue
            current[0] = slot
            row, count = slot.row, int(generation.lengths[slot.row])
            action = Action(slot.record.episode.last.context, tuple(int(i) for i in generation.ids[row, :count]),
                            bool(generation.eos[row]), policy_step=version)
            slot.record.actions.append(ActionRecord(action, generation.old_log_probs[row, :count].tolist(),
                                                    generation.behavior_log_probs[row, :count].tolist()))
            if not action.eos:  # recorded, never sent to a tool
                observation = Observation((), EpisodeStatus.TRUNCATED,
                                          f"the response spent max_new_tokens={self.max_new_tokens} without EOS")
            else:
                observation = _observed(slot, slot.env.step(action))
            slot.record.episode.transitions.append(Transition(action, observation))
            _stop_on_failure(slot, observation)
        return True

    def _report(self, records: list[EpisodeRecord]) -> None:
        if self.record is not None:
            for record in records:
                self.record(record)

    # ----- projection ----------------------------------------------------------------------------

    def project(self, records: list[EpisodeRecord], rows: int) -> dict[str, np.ndarray] | None:
        """The packed GRPO batch of one collection's records; None when every episode is masked."""
        origins = {id(record.origin) for record in records}
        if len(origins) > 1:
            raise ValueError(f"these {len(records)} episode records come from {len(origins)} separate collection "
                             "bindings; project each collection's records on their own")
        sessions = [session_of(record) for record in records]
        batch = pack(sessions, self.width, rows=max(rows, 1), estimator=self.estimator, truncation="mask")
        trained = [s for s in sessions if s.status.name in ("COMPLETED", "AGENT_ERROR")]
        rewards = np.array([s.reward for s in trained], np.float64)
        self.metrics = {
            "reward/mean": float(rewards.mean()) if len(rewards) else float("nan"),
            "episode/turns": float(np.mean([len(r.actions) for r in records])) if records else 0.0,
            "episode/truncated_share": float(np.mean([r.status is EpisodeStatus.TRUNCATED for r in records]))
            if records else 0.0,
        }
        if not (batch["response_mask"] != 0).any():
            return None
        return batch


def _task_ids(batch) -> list[int]:
    if "task_id" not in batch:
        raise KeyError(f"EpisodeRollout needs integer 'task_id' rows; the batch has {sorted(batch)}")
    ids = np.asarray(batch["task_id"])
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or (ids < 0).any():
        raise ValueError(f"task_id must be a [rows] array of non-negative integers, got shape {ids.shape} "
                         f"dtype {ids.dtype}")
    return [int(i) for i in ids]


def _observed(slot: _Slot, observation) -> Observation:
    if not isinstance(observation, Observation):
        raise TypeError(f"the environment of {slot.identity} returned {type(observation).__name__}, not an Observation")
    return observation


def _stop_on_failure(slot: _Slot, observation: Observation) -> None:
    if observation.status in (EpisodeStatus.ERROR, EpisodeStatus.CANCELLED):
        raise _Stop(slot, observation.status, observation.detail)


def _finite(slot: _Slot, reward) -> float:
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise ValueError(f"the verifier returned {reward!r} for {slot.record.describe()}; a finite number is needed")
    return float(reward)


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
