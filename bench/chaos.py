"""Chaos run: the RLVR pipeline under seeded faults, then invariants read from its run directory.

A Ray head is started for the run (its own temporary directory, loopback), and ``dew-ray
rlvr`` runs on it as a separate driver process with several rollout servers and sandbox
runners. This process attaches to the same cluster and injects one fault at a time into the
live pipeline (its actors carry names, ``RolePlacement``), seeded, at random moments
(``--every`` seconds apart on average) or a chosen number after each update a driver trains
(``--per-update``: no update meets more on any machine, bench/fault_schedule.py):

- ``ray.kill`` of a rollout server or of a sandbox runner;
- SIGKILL of a rollout server's process (the engine dying under it);
- SIGKILL of a program the sandbox is running (the newest process under a runner);
- SIGSTOP of a rollout server's process for 0.5 to 3 s, then SIGCONT: its replies are
  delayed, draws and weight loads included;
- SIGSTOP of a rollout server's process for 2.5 to 4 times the pools' ``server_timeout``,
  then SIGCONT: its replies are lost while Ray still sees it alive (the pools set it aside,
  draw its rollouts again elsewhere and take it back once it answers and has loaded);
- once, SIGKILL of the driver process itself after a seeded update; the same command is
  then run again and must resume from its checkpoint;
- with ``--nodes N`` (worker raylets beside the head, ``ray start --address``, where the
  rollout servers and sandbox runners are spread by the ``rollout`` resource): SIGKILL of a
  whole worker node's processes (its actors restart on the others; a fresh node joins in
  its place);
- with ``--trainer-kills K``: up to K times, ``ray.kill`` of the trainer actor (the driver
  starts the run's actors again from the last checkpoint, in the same driver);
- with ``--nodes`` and ``--set servers_max=M`` above ``servers``: the rollout fleet grows
  into each node that joins (a replaced node's newcomer), which the report lists from
  ``fleet.jsonl``; a ``ray.kill`` always leaves another actor of its role listed;
- with ``--set servers_max=M`` above ``servers`` (or ``servers_min`` below it): fleet changes
  by hand, "fleet add" and "fleet remove" of one server, queued for the driver as ``dew-ray
  fleet`` queues them (:func:`dew_ray.pipelines.rlvr_fleet.ask`, a drain of
  ``server_timeout``); the driver applies or refuses each before its next update;
- with ``--engine vllm`` the rollout servers are vLLM engines under their actors, and the
  server faults become: SIGSTOP of an engine's processes (0.5 to 3 s, or 2.5 to 4 times
  ``server_timeout``), SIGKILL of an engine's processes (its actor starts it again), SIGKILL
  of the actor's process (Ray restarts the actor, which starts a new engine) and ``ray.kill``
  of the actor; the poller asks each engine's actor what the engine serves.

Faults start once a driver has trained an update (a driver's start, the actors' and the
restore, is spared), and kills leave at least one actor of each role alive in each
driver's lifetime (a ``ray.kill`` is for good; a SIGKILLed server process is restarted by
Ray and rejoins once loaded). A poller asks every live rollout server what it serves
throughout (a restarted one serves nothing until it has loaded). After the run:

- finished: summary.json reports every update, and the driver's last run exited 0;
- whole groups: every update's admitted rollouts (verl_rows, every process's) hold each
  of its groups whole, ``samples`` rollouts numbered 0..samples-1;
- trained once: no (task, group, sample) appears in two updates of the final lineage, and
  none is missing (``tasks_per_step`` groups per update, metrics.jsonl's tasks exactly);
- versions: no server's polled policy version ever went down (a restarted server's first
  version served is the one it was loaded with);
- checkpoint: the final checkpoint's parameters equal the exported policy's bit for bit,
  and a resumed driver said which update it resumed at, one its checkpoints held;
- fleet requests: each one asked was applied or refused, once, in ``fleet.jsonl``, or was
  still queued when the run ended; none was left taken;
- sandbox: no program the injector killed was reported COMPLETED (checked by
  ``sandbox_chaos``: a SandboxFleet running programs while some are SIGKILLed).

The checks are ``bench/chaos_checks.py``'s.

    uv run python bench/chaos.py [--steps 40] [--seed 0] [--every 3 | --per-update 2] [--nodes 2] [--trainer-kills 1]
        [--set servers_max=5] [--engine vllm]

Prints the faults injected and survived and the invariants; writes bench/results/chaos.{json,png}, the plot
with the updates in metrics.jsonl over time and every fault injected.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from dew_ray.ray_auth import token_auth

token_auth()  # the head and raylets this bench starts ask for Ray's token; the mode is read when ray is imported

import ray  # noqa: E402

from chaos_checks import check_run, fleet_log, print_faults_and_invariants, sandbox_chaos  # noqa: E402
from chaos_plot import plot_timeline  # noqa: E402
from fault_schedule import FaultSchedule  # noqa: E402
from dew.inference.engines import free_port  # noqa: E402
from dew_ray.pipelines.rlvr_config import load_config  # noqa: E402
from dew_ray.pipelines.rlvr_fleet import FleetRequest, ask  # noqa: E402
from processes import descendants, signal_process, stop_ray_head  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
ROLES = ("rollout-server", "sandbox-runner", "trainer")  # the roles faulted, as RolePlacement spells them in names


# ----- processes --------------------------------------------------------------------------------------------------


class RayHead:
    """A Ray head of its own (``ray start --head``) with a private temporary directory; ``address`` to attach."""

    def __init__(self, cpus: int):
        self.temp_dir = tempfile.mkdtemp(prefix="dew-chaos-ray-")
        self.port = free_port()
        self.env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}}
        subprocess.run([str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={self.port}",
                        f"--num-cpus={cpus}", f"--temp-dir={self.temp_dir}", "--include-dashboard=false",
                        "--disable-usage-stats"], check=True, env=self.env, capture_output=True, timeout=180)
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_ray_head(self.temp_dir, self.port)


class RayWorkerNode:
    """A worker raylet joined to ``address`` (``ray start --address ... --block`` in a session of its own) offering
    ``cpus`` CPUs and the ``rollout`` resource; ``lose()`` SIGKILLs the whole session, as a node that vanishes.

    Each node has a temporary directory of its own, as a machine of a real cluster has its disk: raylets that
    share one also share the unpacked ``working_dir`` of the job, and one node's runtime-env agent removing it
    (its own workers done with it) pulled it from under the other nodes' workers (a restarted actor then failed
    to import pydantic, and vLLM engines started again in a folder that no longer existed)."""

    def __init__(self, address: str, env: dict, cpus: int, label: str):
        self.label = label
        self.temp_dir = tempfile.mkdtemp(prefix="dew-chaos-node-")
        self.process = subprocess.Popen(
            [str(Path(sys.executable).parent / "ray"), "start", f"--address={address}", f"--num-cpus={cpus}",
             f'--resources={{"rollout": {4 * cpus}, "{label}": 1}}', "--object-store-memory=300000000", "--block",
             f"--temp-dir={self.temp_dir}", "--disable-usage-stats"], env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)

    def joined(self, within: float = 120.0) -> bool:
        """Wait until the cluster lists this node alive (needs ``ray.init`` in this process)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if any(node["Alive"] and node["Resources"].get(self.label) for node in ray.nodes()):
                return True
            time.sleep(0.2)
        return False

    def lose(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=60)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


# ----- the injector -----------------------------------------------------------------------------------------------


def actor_pid(handle) -> int | None:
    """The process id of a live actor; None when it died or does not answer within 10 s."""
    try:
        return ray.get(handle.__ray_call__.remote(lambda host: os.getpid()), timeout=10)
    except Exception:  # noqa: BLE001 - an actor that died or stalls has no pid to fault
        return None


def pick(rng: random.Random, kinds: list[str], wanted: str | None) -> str | None:
    """``wanted`` if it is one of ``kinds`` (None if not), else a seeded choice among them."""
    if wanted is not None:
        return wanted if wanted in kinds else None
    return rng.choice(kinds)


def stall(rng: random.Random, send: Callable[[int], bool], past: float | None) -> bool:
    """SIGSTOP through ``send`` (a signal to a process, or to an engine's process group) for 0.5 to 3 s, or for 2.5
    to 4 times ``past`` seconds when given, then SIGCONT; False if what it signals is gone."""
    if not send(signal.SIGSTOP):
        return False
    time.sleep(rng.uniform(2.5, 4.0) * past if past is not None else rng.uniform(0.5, 3.0))
    send(signal.SIGCONT)
    return True


def signal_group(group: int | None, sig: int) -> bool:
    """Send ``sig`` to process group ``group``; False when it is gone."""
    if group is None:
        return False
    try:
        os.killpg(group, sig)
        return True
    except ProcessLookupError:
        return False


def kill_newest_under(pid: int | None, within: float, naming: str = "") -> bool:
    """SIGKILL the newest descendant of ``pid`` whose command line holds ``naming``, waited for up to ``within`` s."""
    until = time.monotonic() + within
    while pid is not None:
        found = [child for child in descendants(pid) if naming in _command_line(child)]
        if found:
            return signal_process(found[-1], signal.SIGKILL)
        if time.monotonic() >= until:
            break
        time.sleep(0.02)
    return False


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""



class Injector:
    """Seeded faults into the actors of the run whose actor names start with ``prefix`` (see the module docstring)."""

    def __init__(self, prefix: str, seed: int, servers: int, runners: int, server_timeout: float,
                 nodes: list | None = None, add_node=None, trainer_kills: int = 0, engine: str = "native",
                 run_dir: Path | None = None, fleet: tuple[int, int] | None = None):
        self.prefix, self.random, self.server_timeout = prefix, random.Random(seed), server_timeout
        self.engine, self.run_dir, self.fleet = engine, run_dir, fleet
        self.requests: list[str] = []  # the ids of the fleet requests asked, in order
        self.limits = {"rollout-server": servers - 1, "sandbox-runner": runners - 1}
        self.nodes, self.add_node, self.trainer_kills = nodes if nodes is not None else [], add_node, trainer_kills
        self.faults: Counter = Counter()
        self.log: list[dict] = []
        self.versions: dict[str, list[int]] = {}
        self.progress: list[tuple[float, int]] = []  # (time, metrics.jsonl lines) at every change, for the plot
        self._killed: Counter = Counter()  # per actor-name prefix (one per driver lifetime) and role
        self._pids: dict[str, int] = {}
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_versions, daemon=True)

    def actors(self) -> dict[str, list[str]]:
        """Live named actors of this run, by role."""
        found: dict[str, list[str]] = {role: [] for role in ROLES}
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name = entry["name"]
            if name.startswith(self.prefix):
                role = name.rsplit("/", 1)[-1].rsplit("-", 1)[0]
                if role in found:
                    found[role].append((name, entry["namespace"]))
        return found

    def start(self) -> None:
        self._poller.start()

    def stop(self) -> None:
        self._stop.set()
        self._poller.join(timeout=30)

    def _handle(self, name, namespace):
        return ray.get_actor(name, namespace=namespace)

    def _pid(self, name, namespace) -> int | None:
        if name not in self._pids:
            try:
                handle = self._handle(name, namespace)
            except Exception:  # noqa: BLE001 - an actor that died has no pid to fault
                return None
            pid = actor_pid(handle)
            if pid is None:
                return None
            self._pids[name] = pid
        return self._pids[name]

    def _engine_group(self, name, namespace) -> int | None:
        """The process group of the vLLM engine an engine actor runs (None when the actor does not answer)."""
        try:
            return ray.get(self._handle(name, namespace).process_group.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - a lost or restarting actor has no engine to fault now
            return None

    def _poll_versions(self) -> None:
        while not self._stop.wait(0.3):
            if self.run_dir is not None:  # a resume drops the lines after its checkpoint, so the count can fall
                done = _updates(self.run_dir)
                if not self.progress or self.progress[-1][1] != done:
                    self.progress.append((time.time(), done))
            try:
                servers = self.actors()["rollout-server"]
            except Exception:  # noqa: BLE001 - the GCS is busy or the cluster is going down
                continue
            for name, namespace in servers:
                try:
                    version, stale = ray.get(self._handle(name, namespace).serving.remote(), timeout=2)
                except Exception:  # noqa: BLE001 - killed, stopped or restarting: nothing to observe this round
                    continue
                if not stale:  # a restarted server serves nothing until it has loaded the current weights
                    self.versions.setdefault(name, []).append(int(version))

    def inject(self, wanted: str | None = None) -> str | None:
        """One seeded fault into a live actor (of kind ``wanted`` if given); returns its kind (None when no fault
        was possible now)."""
        actors = self.actors()
        vllm = self.engine == "vllm"
        kinds = ["SIGSTOP vLLM engine" if vllm else "SIGSTOP rollout server", "SIGKILL sandbox program"]
        for role, label in (("rollout-server", "rollout server"), ("sandbox-runner", "sandbox runner")):
            incarnation = actors[role][0][0].rsplit("/", 1)[0] if actors[role] else None
            # servers a growing fleet added have an incarnation of their own: a kill also needs another actor listed
            if incarnation and self._killed[(incarnation, role)] < self.limits[role] and len(actors[role]) >= 2:
                kinds.append(f"ray.kill {label}")
                if role == "rollout-server":  # a stall past the timeout takes a server out for a while, as a kill
                    kinds += ["SIGKILL rollout server process"]
                    kinds += (["SIGKILL vLLM engine", "SIGSTOP vLLM engine past its timeout"] if vllm
                              else ["SIGSTOP rollout server past its timeout"])
        if len(self.nodes) >= 2:  # a node vanishes (its actors restart elsewhere) and a new one joins
            kinds.append("remove node")
        if self.faults["ray.kill trainer"] < self.trainer_kills and actors["trainer"]:
            kinds.append("ray.kill trainer")
        if self.fleet is not None:  # changes by hand, as `dew-ray fleet` asks them of the driver
            low, high = self.fleet
            kinds += ["fleet add"] * (len(actors["rollout-server"]) < high)
            kinds += ["fleet remove"] * (len(actors["rollout-server"]) > low)
        kind = pick(self.random, kinds, wanted)
        if kind in ("fleet add", "fleet remove"):  # applied (or refused) before the driver's next update
            request = FleetRequest(change=kind.split()[1], count=1, drain=self.server_timeout)
            self.requests.append(ask(self.run_dir, request))
            self.faults[kind] += 1
            self.log.append({"time": time.time(), "fault": kind, "request": self.requests[-1]})
            return kind
        if kind == "remove node":
            lost = self.nodes.pop(self.random.randrange(len(self.nodes)))
            lost.lose()
            self.nodes.append(self.add_node())
            self.faults[kind] += 1
            self.log.append({"time": time.time(), "fault": kind, "node": lost.label, "joined": self.nodes[-1].label})
            return kind
        if kind == "ray.kill trainer":  # the driver starts the run's actors again from the last checkpoint
            name, namespace = actors["trainer"][0]
            ray.kill(self._handle(name, namespace), no_restart=True)
            self.faults[kind] += 1
            self.log.append({"time": time.time(), "fault": kind, "actor": name})
            return kind
        role = "rollout-server" if kind and ("rollout server" in kind or "vLLM" in kind) else "sandbox-runner"
        if kind is None or not actors[role]:
            return None
        name, namespace = self.random.choice(sorted(actors[role]))
        incarnation = name.rsplit("/", 1)[0]
        if kind.startswith("ray.kill"):
            ray.kill(self._handle(name, namespace), no_restart=True)
            self._killed[(incarnation, role)] += 1
        elif kind == "SIGKILL rollout server process":
            pid = self._pid(name, namespace)
            if pid is None or not signal_process(pid, signal.SIGKILL):
                return None
            self._pids.pop(name, None)  # Ray restarts it in a new process
            self._killed[(incarnation, role)] += 1
        elif kind.startswith("SIGSTOP rollout server"):
            past = self.server_timeout if kind.endswith("past its timeout") else None
            pid = self._pid(name, namespace)
            if not stall(self.random, lambda sig: pid is not None and signal_process(pid, sig), past):
                return None
        elif kind.startswith("SIGSTOP vLLM engine"):
            past = self.server_timeout if kind.endswith("past its timeout") else None
            group = self._engine_group(name, namespace)
            if not stall(self.random, lambda sig: signal_group(group, sig), past):
                return None
        elif kind == "SIGKILL vLLM engine":  # its actor starts it again at a new address
            if not signal_group(self._engine_group(name, namespace), signal.SIGKILL):
                return None
            self._killed[(incarnation, role)] += 1
        elif not kill_newest_under(self._pid(name, namespace), within=3):  # a program (or its sandbox) of the runner
            return None
        self.faults[kind] += 1
        self.log.append({"time": time.time(), "fault": kind, "actor": name})
        return kind


# ----- the run ----------------------------------------------------------------------------------------------------


def chaos_run(run_dir: Path, steps: int, seed: int, every: float | None, options: list[str], servers: int = 3,
              runners: int = 3, timeout: float = 3600.0, server_timeout: float = 10.0,
              first: Sequence[str] = (), nodes: int = 0, trainer_kills: int = 0, engine: str = "native",
              per_update: int | None = None) -> dict:
    """The pipeline under faults until it finishes (see the module docstring); returns faults and invariants.

    Faults come ``every`` seconds on average, or ``per_update`` after each update a driver trains (``every`` None):
    bench/fault_schedule.py.
    ``first``: fault kinds injected before the seeded ones, in order (each once it is possible); ``nodes``: worker
    nodes beside the head, where the rollout servers and sandbox runners are spread (the ``rollout`` resource),
    which "remove node" faults take away and replace; ``trainer_kills``: how many "ray.kill trainer" faults a run
    may get; ``engine``: the rollout servers' engine ("native" or "vllm").
    """
    head = RayHead(cpus=8 if not nodes else 4)
    name = run_dir.resolve().name
    settings = [f"steps={steps}", f"servers={servers}", f"sandbox_runners={runners}", "server_cpus=0.5",
                "sandbox_cpus=0.25", "verl_rows=true", "progress=false", f"server_timeout={server_timeout:g}",
                f"engine={engine}",
                *(["server_strategy=spread", "sandbox_strategy=spread", 'server_resources={"rollout": 1}',
                   'sandbox_resources={"rollout": 1}'] if nodes else []), *options]
    command = [str(Path(sys.executable).parent / "dew-ray"), "rlvr", "--address", head.address,
               f"--run-dir={run_dir}", *[f"--set={item}" for item in settings]]
    rng = random.Random(seed)
    kill_after = rng.randint(2, max(2, steps - 2))  # the update after which the driver is killed, once
    schedule = FaultSchedule(rng, every=every, per_update=per_update)
    outputs, resumed_at, driver_runs, recoveries = [], [], 0, 0
    workers: list[RayWorkerNode] = []
    try:
        ray.init(address=head.address, log_to_driver=False, configure_logging=False)
        joined = 0

        def add_node() -> RayWorkerNode:
            nonlocal joined
            joined += 1
            node = RayWorkerNode(head.address, head.env, cpus=3, label=f"chaos-node-{joined}")
            workers.append(node)
            if not node.joined():
                raise RuntimeError(f"worker node {node.label} did not join the cluster within 120 s")
            return node

        live = [add_node() for _ in range(nodes)]
        low, high = load_config(None, settings).fleet_bounds()
        injector = Injector(f"dew-rlvr-{name}-", seed + 1, servers, runners, server_timeout, nodes=live,
                            add_node=add_node, trainer_kills=trainer_kills, engine=engine, run_dir=run_dir,
                            fleet=(low, high) if (low, high) != (servers, servers) else None)
        injector.start()
        deadline = time.monotonic() + timeout
        driver_killed, scripted = False, list(first)
        while True:
            driver_runs += 1
            driver = subprocess.Popen(command, cwd=ROOT, env=head.env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
            lines: list[str] = []
            reader = threading.Thread(target=lambda: lines.extend(driver.stdout), daemon=True)
            reader.start()
            # The driver's kill is watched for on a thread of its own: an injection can block for a while (a stall
            # past the timeout lasts 2.5 to 4 times it, a node joins within minutes), and a run that reached its
            # last updates meanwhile would finish without the kill.
            killed: list[int] = []
            killer = threading.Thread(target=_kill_after, args=(driver, run_dir, kill_after, killed), daemon=True)
            if not driver_killed:
                killer.start()
            schedule.start(_updates(run_dir))
            while driver.poll() is None and time.monotonic() < deadline and not killed:
                schedule.poll(_updates(run_dir), injector.inject, scripted)
                time.sleep(0.1)
            if killer.is_alive() and driver.poll() is not None:
                killer.join()
            if killed:
                driver_killed = True
                injector.faults["SIGKILL driver"] += 1
                injector.log.append({"time": time.time(), "fault": "SIGKILL driver", "after_update": killed[0]})
            driver.wait(timeout=120) if driver.poll() is None and driver_killed else None
            if driver.poll() is None:
                driver.kill()
                driver.wait()
                raise TimeoutError(f"the chaos run did not finish within {timeout:g} s")
            reader.join(timeout=10)
            outputs.append("".join(lines))
            # each driver's whole output beside the run, for a failure's cause beyond the last 3,000 characters
            (Path(run_dir) / f"chaos-driver-{driver_runs}.log").write_text(outputs[-1])
            resumed_at += [int(line.rsplit(" ", 1)[-1]) for line in lines if line.startswith("resumed ")]
            recoveries += sum(line.startswith("a trainer was lost") for line in lines)
            if driver.returncode == -signal.SIGKILL:
                continue
            break
        injector.stop()
        exit_code = driver.returncode
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for node in workers:
            node.lose()
        head.stop()
    invariants = check_run(run_dir, injector.versions, resumed_at, exit_code, injector.requests)
    return {"steps": steps, "seed": seed, "servers": servers, "runners": runners, "driver_runs": driver_runs,
            "faults": dict(injector.faults), "injected": sum(injector.faults.values()),
            "survived": sum(injector.faults.values()) if invariants["finished"]["ok"] else 0,
            "resumed_at": resumed_at, "recoveries": recoveries, "nodes": nodes, "engine": engine,
            "fleet": fleet_log(run_dir), "version_polls": injector.versions,
            "invariants": invariants,
            "log": injector.log, "progress": injector.progress,
            "last_output": outputs[-1][-3000:] if outputs else ""}


def _kill_after(driver: subprocess.Popen, run_dir: Path, after: int, killed: list[int]) -> None:
    """SIGKILL ``driver`` once the run directory holds ``after`` updates; ``killed`` gets the count it saw."""
    while driver.poll() is None:
        done = _updates(run_dir)
        if done >= after:
            driver.send_signal(signal.SIGKILL)
            killed.append(done)
            return
        time.sleep(0.1)


def _updates(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    timing = parser.add_mutually_exclusive_group()
    timing.add_argument("--every", type=float, default=3.0, help="mean seconds between faults")
    timing.add_argument("--per-update", type=int, default=None,
                        help="faults after each update a driver trains, instead of on a clock")
    parser.add_argument("--programs", type=int, default=200, help="programs of the sandbox part")
    parser.add_argument("--server-timeout", type=float, default=10.0,
                        help="the pools' server_timeout; the long stalls last 2.5 to 4 times it")
    parser.add_argument("--nodes", type=int, default=0, help="worker nodes beside the head (node-loss faults)")
    parser.add_argument("--trainer-kills", type=int, default=0, help="ray.kill faults of the trainer actor")
    parser.add_argument("--engine", choices=("native", "vllm"), default="native",
                        help="the rollout servers: dew's native servers or vLLM engines (the engine environment)")
    parser.add_argument("--run-dir", default=None, help="default: a fresh runs/chaos-<seed>-<time>")
    parser.add_argument("--set", action="append", default=[], help="more pipeline config overrides")
    args = parser.parse_args()
    run_dir = Path(args.run_dir or ROOT / "runs" / f"chaos-{args.seed}-{int(time.time())}").resolve()
    began = time.perf_counter()
    every = None if args.per_update is not None else args.every
    result = chaos_run(run_dir, args.steps, args.seed, every, args.set, server_timeout=args.server_timeout,
                       nodes=args.nodes, trainer_kills=args.trainer_kills, engine=args.engine,
                       per_update=args.per_update)
    result["sandbox"] = sandbox_chaos(args.programs, args.seed)
    result["seconds"] = time.perf_counter() - began
    print(f"\nchaos run {run_dir}: {args.steps} updates, seed {args.seed}, {result['driver_runs']} driver runs, "
          f"{result['seconds']:.0f} s")
    print_faults_and_invariants(result)
    sandbox = result["sandbox"]
    print(f"    {'ok  ' if sandbox['ok'] else 'FAIL'} {'killed programs not COMPLETED':<30} {sandbox['killed']} of "
          f"{sandbox['programs']} programs killed, verdicts {sandbox['verdicts']}, reported completed "
          f"{sandbox['killed_reported_completed']}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "chaos.json").write_text(json.dumps(result, indent=2))
    plot_timeline(result, RESULTS / "chaos.png")
    print(f"wrote {RESULTS / 'chaos.json'} and {RESULTS / 'chaos.png'}")
    ok = all(v["ok"] for v in result["invariants"].values()) and sandbox["ok"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
