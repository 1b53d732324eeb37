"""``EpisodeJournal``: crash-safe resume of in-flight tool episodes, one SQLite WAL per rank.

``EpisodeRollout(..., journal=EpisodeJournal("run/episodes"))`` writes, for each
collection, every episode's reset observation and environment snapshot, each block's
sampled draws as *pending* turns before any tool runs (one transaction per block), each
turn as *completed* (its observation and the environment's snapshot after it) before the
next tool call, and each verified reward. SQLite runs in WAL mode with
``synchronous=FULL``, so a committed turn survives a crash of the process or the machine.

A run restarted from its checkpoint collects the same attempted step again; the journal
then restores what was recorded: environments come back through ``set_state`` (no second
reset), completed turns with their exact contexts, likelihoods and observations, pending
draws are reused instead of sampled again, and recorded rewards are not verified again.
The one call that can run twice is a tool call that was pending when the process died:
an environment must make such effects idempotent from the episode identity and action.
It cannot resume in the middle of a tool call.

A collection is identified by its fingerprint: the task ids, the rollout's options
(budgets, sampling controls, estimator), the topology (processes, this rank, local
devices), the training clocks (committed updates and attempted steps), the key and a SHA-256 digest of this rank's policy weights
(read once per collection). The newest collection is resumed when the fingerprint
matches; one at the same clock and key that differs in anything else is refused, naming
what differs; one from another clock or key is discarded (the run moved on, or restored
an older checkpoint). A second process opening the same rank's journal is refused.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import sqlite3
from pathlib import Path

import jax
import numpy as np

from dew.records.episode_records import ActionRecord
from dew.records.episode_protocol import Action, EpisodeStatus, Observation

SCHEMA = """
CREATE TABLE IF NOT EXISTS collections (id INTEGER PRIMARY KEY, fingerprint TEXT NOT NULL, done INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS resets (collection INTEGER, slot INTEGER, observation TEXT, snapshot BLOB,
                                   PRIMARY KEY (collection, slot));
CREATE TABLE IF NOT EXISTS turns (collection INTEGER, slot INTEGER, turn INTEGER, action TEXT, observation TEXT,
                                  snapshot BLOB, PRIMARY KEY (collection, slot, turn));
CREATE TABLE IF NOT EXISTS rewards (collection INTEGER, slot INTEGER, reward REAL, PRIMARY KEY (collection, slot));
"""
CHECKED = ("tasks", "options", "topology", "policy")  # what must match a collection at the same clock and key


class JournalError(RuntimeError):
    """The journal cannot serve this collection (a concurrent writer, or a mismatched recovery); it says which."""


@dataclasses.dataclass
class Recorded:
    """One slot's recorded turn: the draw, and once completed the observation and snapshot after it."""

    action: ActionRecord
    observation: Observation | None = None
    snapshot: bytes | None = None


def policy_digest(host_variables) -> str:
    """SHA-256 over this rank's policy weights (host copies), in tree order with their shapes and dtypes."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(host_variables):
        array = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{array.dtype}{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


class EpisodeJournal:
    """One run's journal directory; each rank writes ``rank-<process>.sqlite`` (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._connection: sqlite3.Connection | None = None
        self._lock = None
        self.collection: int | None = None
        self.resets: dict[int, tuple[Observation, bytes]] = {}
        self.turns: dict[int, dict[int, Recorded]] = {}
        self.rewards: dict[int, float] = {}

    # ----- opening -------------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        if self._connection is not None:
            return self._connection
        self.directory.mkdir(parents=True, exist_ok=True)
        rank = jax.process_index()
        lock = open(self.directory / f"rank-{rank}.lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise JournalError(f"another process is writing the episode journal {self.directory} for rank {rank}; "
                               "use one journal directory per run") from None
        self._lock = lock
        connection = sqlite3.connect(self.directory / f"rank-{rank}.sqlite", isolation_level=None)
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=FULL")
        connection.executescript(SCHEMA)
        self._connection = connection
        return connection

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None

    # ----- a collection --------------------------------------------------------------------------

    def begin(self, fingerprint: dict) -> bool:
        """Start or resume the collection of ``fingerprint``; True when it resumes recorded work."""
        connection = self._open()
        text = json.dumps(fingerprint, sort_keys=True)
        newest = connection.execute("SELECT id, fingerprint FROM collections ORDER BY id DESC LIMIT 1").fetchone()
        self.resets, self.turns, self.rewards = {}, {}, {}
        if newest is not None and newest[1] == text:
            self.collection = newest[0]
            self._load()
            return True
        if newest is not None:
            recorded = json.loads(newest[1])
            if (recorded["clock"], recorded["key"]) == (fingerprint["clock"], fingerprint["key"]):
                differs = [name for name in CHECKED if recorded.get(name) != fingerprint.get(name)]
                updates, step = fingerprint["clock"]
                raise JournalError(
                    f"the episode journal {self.directory} holds a collection at the same training clocks (update "
                    f"{updates}, step {step}) and key, made with different {', '.join(differs)} (recorded "
                    f"{ {name: recorded.get(name) for name in differs} }, now { {name: fingerprint.get(name) for name in differs} }); "
                    "a resumed run must restore the same checkpoint, data and policy"
                )
        with _transaction(connection):
            for table in ("resets", "turns", "rewards", "collections"):  # only the newest collection is ever resumed
                connection.execute(f"DELETE FROM {table}")
            self.collection = connection.execute("INSERT INTO collections (fingerprint, done) VALUES (?, 0)",
                                                 (text,)).lastrowid
        return False

    def _load(self) -> None:
        connection, collection = self._connection, self.collection
        for slot, observation, snapshot in connection.execute(
                "SELECT slot, observation, snapshot FROM resets WHERE collection = ?", (collection,)):
            self.resets[slot] = (_observation(observation), snapshot)
        for slot, turn, action, observation, snapshot in connection.execute(
                "SELECT slot, turn, action, observation, snapshot FROM turns WHERE collection = ? ORDER BY turn",
                (collection,)):
            recorded = Recorded(_action(action), None if observation is None else _observation(observation), snapshot)
            self.turns.setdefault(slot, {})[turn] = recorded
        for slot, reward in connection.execute("SELECT slot, reward FROM rewards WHERE collection = ?", (collection,)):
            self.rewards[slot] = reward

    def reset(self, slot: int, observation: Observation, snapshot: bytes) -> None:
        with _transaction(self._connection):
            self._connection.execute("INSERT OR REPLACE INTO resets VALUES (?, ?, ?, ?)",
                                     (self.collection, slot, _observation_text(observation), snapshot))
        self.resets[slot] = (observation, snapshot)

    def pending(self, turn: int, draws: dict[int, ActionRecord]) -> None:
        """A block's draws for ``turn``, in one transaction, before any of them reaches a tool."""
        with _transaction(self._connection):
            for slot, draw in draws.items():
                self._connection.execute("INSERT OR REPLACE INTO turns VALUES (?, ?, ?, ?, NULL, NULL)",
                                         (self.collection, slot, turn, _action_text(draw)))
        for slot, draw in draws.items():
            self.turns.setdefault(slot, {})[turn] = Recorded(draw)

    def complete(self, slot: int, turn: int, observation: Observation, snapshot: bytes | None) -> None:
        with _transaction(self._connection):
            self._connection.execute(
                "UPDATE turns SET observation = ?, snapshot = ? WHERE collection = ? AND slot = ? AND turn = ?",
                (_observation_text(observation), snapshot, self.collection, slot, turn))
        recorded = self.turns[slot][turn]
        recorded.observation, recorded.snapshot = observation, snapshot

    def reward(self, slot: int, reward: float) -> None:
        with _transaction(self._connection):
            self._connection.execute("INSERT OR REPLACE INTO rewards VALUES (?, ?, ?)", (self.collection, slot, reward))
        self.rewards[slot] = reward

    def finish(self) -> None:
        with _transaction(self._connection):
            self._connection.execute("UPDATE collections SET done = 1 WHERE id = ?", (self.collection,))


class _transaction:
    def __init__(self, connection: sqlite3.Connection):
        self.connection = connection

    def __enter__(self):
        self.connection.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind, value, traceback):
        self.connection.execute("COMMIT" if kind is None else "ROLLBACK")


def _action_text(draw: ActionRecord) -> str:
    action = draw.action
    return json.dumps({"context": list(action.context), "tokens": list(action.tokens), "eos": action.eos,
                       "policy_step": action.policy_step, "old": list(draw.old_log_probs),
                       "behavior": list(draw.behavior_log_probs)})


def _action(text: str) -> ActionRecord:
    data = json.loads(text)
    return ActionRecord(Action(tuple(data["context"]), tuple(data["tokens"]), data["eos"], data["policy_step"]),
                        data["old"], data["behavior"])


def _observation_text(observation: Observation) -> str:
    return json.dumps({"context": list(observation.context), "status": observation.status.value,
                       "detail": observation.detail})


def _observation(text: str) -> Observation:
    data = json.loads(text)
    return Observation(tuple(data["context"]), EpisodeStatus(data["status"]), data["detail"])
