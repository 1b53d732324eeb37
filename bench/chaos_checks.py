"""The invariants of a chaos run (``bench/chaos.py``), read from its run directory, and the sandbox under kills.

``check_run`` checks what the module docstring of ``bench/chaos.py`` lists (finished, whole
groups, trained once, versions, checkpoint, resume, and the fleet requests the injector asked:
each one applied or refused in ``fleet.jsonl``, or still queued when the run ended, none left
taken); ``sandbox_chaos`` runs a SandboxFleet while a seeded killer SIGKILLs some of its
programs; ``print_faults_and_invariants`` prints a result of either chaos bench.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from dew.models.pretrained import Pretrained
from dew.records.verl_rows import from_verl
from dew.sandbox import ProcessRunner, Program, SandboxFleet, SandboxLimits, Verdict
from dew_ray.pipelines.rlvr_fleet import REQUESTS
from processes import signal_process


def fleet_log(run_dir: Path) -> list[dict]:
    """The run's fleet changes (fleet.jsonl: with servers_max above servers, a node that joins gets a server)."""
    path = run_dir / "fleet.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ----- the invariants ---------------------------------------------------------------------------------------------


def check_run(run_dir: Path, versions: dict[str, list[int]], resumed_at: list[int], exit_code: int,
              requests: Sequence[str] = ()) -> dict:
    config = json.loads((run_dir / "config.json").read_text())
    steps, samples, per_step = config["steps"], config["samples"], config["tasks_per_step"]
    out: dict[str, dict] = {}
    summary = run_dir / "summary.json"
    finished = exit_code == 0 and summary.exists() and json.loads(summary.read_text())["steps"] == steps
    out["finished"] = {"ok": finished, "detail": f"exit {exit_code}, summary {'present' if summary.exists() else 'absent'}"}
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    out["updates once each"] = {"ok": [row["step"] for row in rows] == list(range(1, steps + 1)),
                                "detail": f"{len(rows)} rows"}
    keys, broken, mismatched = [], [], []
    for row in rows:
        path = run_dir / "verl_rows" / f"update-{row['step']:06d}.jsonl"
        sessions = [t.session for t in from_verl([json.loads(x) for x in path.read_text().splitlines()])]
        groups: dict[tuple, list[int]] = {}
        for session in sessions:
            groups.setdefault((session.task.id, session.group), []).append(session.sample)
            keys.append((session.task.id, session.group, session.sample))
        broken += [(row["step"], group) for group, drawn in groups.items() if sorted(drawn) != list(range(samples))]
        if len(groups) != per_step or sorted({task for task, _ in groups}) != sorted(row["tasks"]):
            mismatched.append(row["step"])
    out["whole groups"] = {"ok": not broken, "detail": f"{len(broken)} broken groups {broken[:3]}"}
    out["no sample trained twice"] = {"ok": len(keys) == len(set(keys)),
                                      "detail": f"{len(keys)} rollouts, {len(keys) - len(set(keys))} repeated"}
    out["no group lost"] = {"ok": not mismatched and len(keys) == steps * per_step * samples,
                            "detail": f"{len(keys)} of {steps * per_step * samples} rollouts; updates off: {mismatched}"}
    down = {name: next((i, a, b) for i, (a, b) in enumerate(zip(seen, seen[1:])) if b < a)
            for name, seen in versions.items() if any(b < a for a, b in zip(seen, seen[1:]))}
    out["versions never go back"] = {"ok": not down and bool(versions),
                                     "detail": f"{sum(map(len, versions.values()))} polls of {len(versions)} servers, "
                                               f"versions {min(map(min, versions.values()), default=None)} to "
                                               f"{max(map(max, versions.values()), default=None)}"
                                               + "".join(f"; {name} went from {a} to {b} at poll {i + 1} of "
                                                         f"{len(versions[name])}" for name, (i, a, b) in down.items())}
    out["checkpoint equals the policy"] = checkpoint_matches_policy(run_dir)
    kept = sorted(int(p.name) for p in (run_dir / "grpo").glob("*") if p.name.isdigit())
    out["resumed at a checkpoint"] = {"ok": all(0 < step <= steps for step in resumed_at),
                                      "detail": f"resumed at {resumed_at}; checkpoints now {kept}"}
    if requests:
        out["fleet requests answered"] = fleet_requests_answered(run_dir, requests)
    return out


def fleet_requests_answered(run_dir: Path, requests: Sequence[str]) -> dict:
    """Every fleet request asked (its id) was applied or refused, each once, in fleet.jsonl, or was still queued when
    the run ended (asked after the driver's last look); none was left taken and unanswered."""
    log = fleet_log(run_dir)
    answers = Counter(entry["request"] for entry in log if "request" in entry)
    folder = run_dir / REQUESTS
    queued = {path.stem for path in folder.glob("*.json")} if folder.exists() else set()
    taken = sorted(path.stem for path in folder.glob("*.taken")) if folder.exists() else []
    unanswered = [ident for ident in requests if not answers[ident] and ident not in queued]
    twice = [ident for ident in requests if answers[ident] > 1]
    refused = sum(1 for entry in log if entry["change"] == "refused")
    return {"ok": not unanswered and not twice and not taken,
            "detail": f"{len(requests)} asked: {sum(answers[i] > 0 for i in requests) - refused} applied, {refused} "
                      f"refused, {len(queued)} queued at the end; unanswered {unanswered[:3]}, twice {twice[:3]}, "
                      f"taken {taken[:3]}"}


def checkpoint_matches_policy(run_dir: Path) -> dict:
    """The newest checkpoint's parameters (the first leaves of its train state) against the exported policy."""
    if not (run_dir / "policy" / "config.json").exists():
        return {"ok": False, "detail": "no exported policy (the run did not finish)"}
    manager = ocp.CheckpointManager((run_dir / "grpo").absolute())
    step = manager.latest_step()
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state
    manager.close()
    policy = jax.tree.leaves(Pretrained.from_directory(run_dir / "policy").load())
    saved = [np.asarray(state[name]) for name in sorted(state)[: len(policy)]]
    equal = all(a.shape == b.shape and np.array_equal(a, np.asarray(b)) for a, b in zip(saved, policy, strict=True))
    return {"ok": equal, "detail": f"checkpoint {step}: {len(policy)} arrays {'bit-equal' if equal else 'DIFFER'}"}


# ----- the sandbox under kills ------------------------------------------------------------------------------------


def sandbox_chaos(programs: int, seed: int, workers: int = 2) -> dict:
    """``programs`` sleeping programs on a SandboxFleet while a seeded killer SIGKILLs the processes of some; every
    killed program's verdict must be something other than COMPLETED."""
    rng = random.Random(seed)
    marker = f"dew-chaos-{os.getpid()}-{seed}"
    fleet = SandboxFleet(ProcessRunner(), limits=SandboxLimits(wall_seconds=30), workers=workers)
    killed: set[int] = set()
    stop = threading.Event()

    def killer():
        while not stop.wait(rng.uniform(0.05, 0.3)):
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    line = (entry / "cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                if marker in line and "#" in line and rng.random() < 0.5:
                    index = int(line.split(marker + "-")[1].split()[0].strip("\x00#'\""))
                    if signal_process(int(entry.name), signal.SIGKILL):
                        killed.add(index)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        sources = [f"import time  # {marker}-{i}\ntime.sleep({rng.uniform(0.2, 0.6):.2f})\nprint('done {i}')\n"
                   for i in range(programs)]
        outcomes = fleet.map([Program(argv=("python3", "-c", source)) for source in sources])
    finally:
        stop.set()
        thread.join()
        fleet.close()
    completed_killed = sorted(i for i in killed if outcomes[i].verdict is Verdict.COMPLETED)
    return {"programs": programs, "killed": len(killed), "verdicts": dict(Counter(o.verdict.value for o in outcomes)),
            "killed_reported_completed": completed_killed, "ok": bool(killed) and not completed_killed}


def print_faults_and_invariants(result: dict) -> None:
    """The faults injected, and survived if the run finished, and each invariant's verdict."""
    survived = result["injected"] if result["invariants"]["finished"]["ok"] else 0
    print(f"  faults injected {result['injected']}, survived {survived}:")
    for kind, count in sorted(result["faults"].items()):
        print(f"    {kind:<40} {count}")
    for change in result.get("fleet", []):
        what = f"refused: {change['refused']}" if change["change"] == "refused" else \
            f"{change['change']} {', '.join(change['servers'])} ({change.get('why', 'asked')})"
        print(f"  fleet after update {change['step']}: {what}, {change['size']} servers")
    print("  invariants:")
    for name, verdict in result["invariants"].items():
        print(f"    {'ok  ' if verdict['ok'] else 'FAIL'} {name:<30} {verdict['detail']}")
