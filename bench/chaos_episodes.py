"""Chaos run of tool episodes: environment actors, their tool processes and the rollout servers under seeded faults.

GRPO trains through a RolloutScheduler on a RemoteEnvironmentSource: ``workers``
EnvironmentWorker actors run multi-turn sessions of the counting tool
(bench/counting_worker.py, one SubprocessEnvironment process per session) whose model
calls go to a ServerPool of ``servers`` RolloutServerActors (the tests' sharp decoder).
An injector on a thread of this process faults the live actors, one at a time, seeded, at
random moments (``--every`` seconds apart on average) or a chosen number after each batch of
rollouts (``--per-update``: bench/fault_schedule.py):

- ``ray.kill`` of an environment worker (its sessions come back INFRA_ERROR and are run
  again on the others) or of a rollout server;
- SIGKILL of a tool process under an environment worker (the session ends in an error
  observation and is run again);
- SIGSTOP of a rollout server for 0.5 to 3 s, or for 2.5 to 4 times the pools'
  ``server_timeout`` (its replies are lost while Ray sees it alive: the pools set it aside
  and take it back once it answers), then SIGCONT.

Kills leave at least one actor of each role alive. A poller asks every rollout server its
version throughout. Invariants, from the scheduler's records: every update trained, each
``tasks_per_step`` groups whole (``samples`` sessions numbered 0..samples-1, none of them
an error) and none abandoned; no (task, group, sample) trained twice; no server's version
going down; and each killed tool process's session was run again (resubmissions for
infrastructure errors at least the tool kills that hit a running session).

    uv run python bench/chaos_episodes.py [--steps 30] [--seed 0] [--every 1.0 | --per-update 2]

Prints the faults and the invariants; writes bench/results/chaos_episodes.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import optax
import ray
from ray import cloudpickle

from dew import Dataset, Trainer
from dew.collection.scheduler import RolloutScheduler
from dew.inference import ServingTask
from dew.objectives.grpo import GRPOObjective
from dew.records.episode_protocol import EpisodeStatus
from dew.records.session_records import Status, Task
from dew.sampling import Sampling
from dew.sandbox import SandboxLimits, SubprocessEnvironment
from dew_ray.actors import RemoteEnvironmentSource, start_environment_workers, start_rollout_servers
from chaos import actor_pid, kill_newest_under, pick, stall
from chaos_checks import print_faults_and_invariants
from fault_schedule import FaultSchedule
from processes import signal_process
from load import sharp_decoder

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WORKER = Path(__file__).resolve().parent / "counting_worker.py"
WIDTH = 32
EOS = tuple(range(16))  # half the sharp decoder's ids end a model call, so most calls end before their budget


def verifier(task, episode) -> float:
    """One point per model call of a completed episode, and a point more for an even last sampled id."""
    if episode.status is not EpisodeStatus.COMPLETED:
        return 0.0
    last = episode.transitions[-1].action.tokens
    return float(len(episode.transitions)) + float(bool(last) and last[-1] % 2 == 0)


class EpisodeInjector:
    """Seeded faults into the run's live actors (see the module docstring)."""

    def __init__(self, seed: int, servers: list, workers: list, server_timeout: float):
        self.random, self.server_timeout = random.Random(seed), server_timeout
        self.live = {"rollout server": list(servers), "environment worker": list(workers)}
        self.pids = {id(actor): actor_pid(actor) for actor in self.live["rollout server"] + self.live["environment worker"]}
        self.faults: Counter = Counter()
        self.log: list[dict] = []
        self.versions: dict[int, list[int]] = {}
        self.stop = threading.Event()

    def poll_versions(self) -> None:
        while not self.stop.wait(0.3):
            for actor in self.live["rollout server"]:
                try:
                    self.versions.setdefault(id(actor), []).append(int(ray.get(actor.version.remote(), timeout=2)))
                except Exception:  # noqa: BLE001 - killed or stopped: nothing to observe this round
                    continue

    def inject(self, wanted: str | None = None) -> str | None:
        """One seeded fault (of kind ``wanted`` if given and possible); returns its kind, None if none was made."""
        kinds = ["SIGKILL tool process", "SIGSTOP rollout server"]
        for role in self.live:
            if len(self.live[role]) > 1:
                kinds.append(f"ray.kill {role}")
        if len(self.live["rollout server"]) > 1:
            kinds.append("SIGSTOP rollout server past its timeout")
        kind = pick(self.random, kinds, wanted)
        if kind is None:
            return None
        role = "rollout server" if "rollout server" in kind else "environment worker"
        actor = self.random.choice(self.live[role])
        pid = self.pids[id(actor)]
        if kind.startswith("ray.kill"):
            ray.kill(actor, no_restart=True)
            self.live[role].remove(actor)
        elif kind.startswith("SIGSTOP"):
            if not stall(self.random, lambda sig: pid is not None and signal_process(pid, sig), self.server_timeout if kind.endswith("past its timeout") else None):
                return None
        elif not kill_newest_under(pid, within=2, naming=str(WORKER)):  # a tool process of the worker
            return None
        self.faults[kind] += 1
        self.log.append({"time": time.time(), "fault": kind})
        return kind


def episode_chaos(steps: int, seed: int, every: float | None, servers: int = 3, workers: int = 3,
                  tasks_per_step: int = 2, samples: int = 4, server_timeout: float = 5.0, first=(),
                  per_update: int | None = None) -> dict:
    """Train ``steps`` GRPO updates through environment workers under faults; returns faults and invariants.

    ``first``: fault kinds injected before the seeded ones, in order (each once it is possible). Faults come
    ``every`` seconds on average, or ``per_update`` after each batch of rollouts (``every`` None).
    """
    cloudpickle.register_pickle_by_value(sys.modules[verifier.__module__])  # the actors cannot import bench/
    model, variables = sharp_decoder(64)
    task = ServingTask(model, variables, Sampling(eos_id=EOS, temperature=1.0, top_k=8))
    pool = start_rollout_servers(task, servers, slots=4, capacity=64, version=0, num_cpus=0.25,
                                 timeout=server_timeout)
    environment = SubprocessEnvironment([sys.executable, str(WORKER)], SandboxLimits(wall_seconds=120)).for_task
    actors = start_environment_workers(workers, pool, environment, verifier, num_cpus=0.25,
                                       server_timeout=server_timeout, max_prompt_tokens=WIDTH - 4, max_new_tokens=4,
                                       max_turns=4, workers=4, eos_ids=EOS)
    source = RemoteEnvironmentSource(actors)
    objective = GRPOObjective(model, seq_len=WIDTH - 1, behavior_importance=2.0, pretrained=variables)
    records = []
    scheduler = RolloutScheduler(objective, source, pool, width=WIDTH, rows=tasks_per_step * samples,
                                 tasks=lambda batch: [Task(str(int(i)), {}) for i in batch["task_id"]],
                                 groups=samples, max_lag=1, ahead=1, truncation="score", max_attempts=6,
                                 log=records.append)
    injector = EpisodeInjector(seed, [s.actor for s in pool.servers], actors, server_timeout)
    schedule = FaultSchedule(random.Random(seed), every=every, per_update=per_update)
    schedule.start(0)
    batches = [0]  # batches of rollouts in: faults start once the first is (compilation spared)
    scripted = list(first)

    def faults():
        while not injector.stop.wait(0.05):
            schedule.poll(batches[0], injector.inject, scripted)

    threads = [threading.Thread(target=injector.poll_versions, daemon=True), threading.Thread(target=faults,
                                                                                               daemon=True)]
    for thread in threads:
        thread.start()

    data = Dataset(train=lambda partition: ({"task_id": np.arange(tasks_per_step) + tasks_per_step * i}
                                            for i in itertools.count()))
    def rollout(batch, variables, version, key):
        out = scheduler(batch, variables, version, key)
        batches[0] += 1
        return out

    trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(seed), rollout=rollout, progress=False)
    began = time.perf_counter()
    try:
        state = trainer.fit(scheduler.tasks(data), steps=steps)
        updates = int(state.updates)
    finally:
        injector.stop.set()
        for thread in threads:
            thread.join(timeout=60)
        scheduler.close()
        pool.close()
        for actor in injector.live["rollout server"] + injector.live["environment worker"]:
            ray.kill(actor)
    invariants = check_records(records, updates, steps, tasks_per_step, samples, injector)
    return {"steps": steps, "seed": seed, "seconds": time.perf_counter() - began, "faults": dict(injector.faults),
            "injected": sum(injector.faults.values()), "invariants": invariants, "log": injector.log}


def check_records(records, updates: int, steps: int, tasks_per_step: int, samples: int, injector) -> dict:
    out = {"finished": {"ok": updates == steps, "detail": f"{updates} of {steps} updates"}}
    trained = [r for r in records if r.sessions]
    keys, broken, short = [], [], []
    for index, record in enumerate(trained):
        groups: dict[tuple, list] = {}
        for session in record.sessions:
            groups.setdefault((session.task.id, session.group), []).append(session)
            keys.append((session.task.id, session.group, session.sample))
        broken += [(index, group) for group, sessions in groups.items()
                   if sorted(s.sample for s in sessions) != list(range(samples))
                   or any(s.status is Status.INFRA_ERROR for s in sessions)]
        if len(groups) != tasks_per_step or record.abandoned_groups:
            short.append(index)
    out["whole groups"] = {"ok": not broken, "detail": f"{len(broken)} broken groups {broken[:3]}"}
    out["no sample trained twice"] = {"ok": len(keys) == len(set(keys)),
                                      "detail": f"{len(keys)} sessions, {len(keys) - len(set(keys))} repeated"}
    out["no group lost"] = {"ok": len(trained) == steps and not short and len(keys) == steps * tasks_per_step * samples,
                            "detail": f"{len(keys)} of {steps * tasks_per_step * samples} sessions; updates short: {short}"}
    versions = injector.versions
    down = [seen for seen in versions.values() if any(b < a for a, b in zip(seen, seen[1:]))]
    out["versions never go back"] = {"ok": not down and bool(versions),
                                     "detail": f"{sum(map(len, versions.values()))} polls of {len(versions)} servers"}
    infra = sum(r.resubmissions.get("infra_error", 0) for r in records)
    tools = injector.faults["SIGKILL tool process"]
    out["killed sessions run again"] = {"ok": infra >= tools,
                                        "detail": f"{tools} tool processes killed, {infra} infrastructure-error "
                                                  "resubmissions"}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    timing = parser.add_mutually_exclusive_group()
    timing.add_argument("--every", type=float, default=1.0, help="mean seconds between faults")
    timing.add_argument("--per-update", type=int, default=None,
                        help="faults after each batch of rollouts, instead of on a clock")
    parser.add_argument("--server-timeout", type=float, default=5.0)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        every = None if args.per_update is not None else args.every
        result = episode_chaos(args.steps, args.seed, every, server_timeout=args.server_timeout,
                               per_update=args.per_update)
    finally:
        ray.shutdown()
    print(f"\nepisode chaos run: {args.steps} updates, seed {args.seed}, {result['seconds']:.0f} s")
    print_faults_and_invariants(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "chaos_episodes.json").write_text(json.dumps(result, indent=2))
    sys.exit(0 if all(v["ok"] for v in result["invariants"].values()) else 1)


if __name__ == "__main__":
    main()
