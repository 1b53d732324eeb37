"""What every pipeline driver does before its actors start: the run directory and the local Ray cluster.

``resolve_run_dir`` gives the run directory as the absolute path every actor is given: a
relative one resolves against the driver's working directory, a submitted job (``ray job
submit``, whose driver runs in a packaged copy of the working directory that dies with the
session) must give an absolute path every node reaches, and a URI is refused (the pipelines
write with local file I/O). ``writable`` checks it can be written, and ``shared_on_nodes``
that every node the run uses reads and writes the same directory; ``check_sandbox`` starts one
program in the configured sandbox; ``start_ray`` starts the local cluster of one run (Ray's
token authentication as Ray sets it) unless ``address`` or ``RAY_ADDRESS`` names a cluster.
A local cluster's workers run this driver's own interpreter, whatever started it: under
``uv run`` Ray would otherwise package the working directory and start every worker with
``uv run`` there (its uv hook), which fails from a folder outside the project (the project's
``pyproject.toml`` is not in it) and packages a Ray temp dir inside it. Attaching to a cluster
under ``uv run`` keeps Ray's hook (the cluster's nodes may not have dew-ray installed), so a
``RAY_TMPDIR`` inside the directory it packages is refused, naming both.
``pipeline_main`` is every pipeline's ``python -m`` entry: ``--config``, ``--set`` and
``--address``, errors in the configuration or the preflight printed and exit status 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import ray
from ray._private import ray_constants
from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR
from ray._private.runtime_env.uv_runtime_env_hook import _get_uv_run_cmdline
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dew.hugepages import hugepage_environment
from dew.recipes.rlvr_recipe import CONTAINER_IMAGE, sandbox_runner
from dew.sandbox import BwrapRunner, ContainerRunner, Program, SandboxLimits, Verdict
from dew_ray.placement import alive_nodes


class PreflightError(RuntimeError):
    """A check made before any work starts failed; the message names the fix."""


def submitted_job() -> bool:
    """Whether this driver runs as a submitted Ray job (``ray job submit``): the job supervisor sets its config."""
    return RAY_JOB_CONFIG_JSON_ENV_VAR in os.environ


def resolve_run_dir(run_dir: str) -> Path:
    """The run directory as the absolute path every actor is given (see the module docstring)."""
    if "://" in run_dir:
        raise PreflightError(f"config field 'run_dir' is a URI ({run_dir!r}); the pipeline writes its run directory with "
                             "local file I/O: give an absolute path on a filesystem every node reaches")
    path = Path(run_dir).expanduser()
    if not path.is_absolute() and submitted_job():
        raise PreflightError(
            f"config field 'run_dir' is relative ({run_dir!r}) and this driver runs as a submitted Ray job, inside a "
            f"packaged copy of the working directory ({os.getcwd()}) that is deleted with the Ray session: pass an "
            f"absolute path every node reaches, for example --set run_dir=$PWD/{run_dir} on a one-machine cluster "
            "or a path on a shared filesystem")
    return path.resolve()


def writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".dew-write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        raise PreflightError(f"the run directory {run_dir} is not writable ({error}); set run_dir to a directory you "
                             "can write") from None


def _node_check(run_dir: str, token: str) -> str | None:
    """On one node: the driver's token file is there, and a file written here reads back; None, or what failed."""
    directory = Path(run_dir)
    try:
        seen = (directory / f".dew-shared-{token}").read_text()
    except OSError as error:
        return f"the driver's check file is not there ({error.strerror or error})"
    if seen != token:
        return "the driver's check file reads back different here"
    mine = directory / f".dew-shared-{token}-{ray.get_runtime_context().get_node_id()[:12]}"
    try:
        mine.write_text(token)
        back = mine.read_text()
        mine.unlink()
    except OSError as error:
        return f"it cannot be written there ({error})"
    return None if back == token else "a file written there reads back different"


def shared_on_nodes(run_dir: Path, nodes: dict[str, str], timeout: float = 120.0) -> None:
    """Prove that every node in ``nodes`` (node id -> address) reaches the run directory the driver writes: a small
    task on each reads a file the driver wrote, writes its own, reads it back and removes it. Raises PreflightError
    naming the first node that does not. A node that leaves the cluster before its check has run is passed over:
    it holds none of the run's actors any more (Ray moves their bundles to nodes that are left). A check that Ray
    could not run (its worker or node lost) is asked again until ``timeout``: a node being removed stays listed
    alive until Ray's health check has missed it several times, and is passed over once it is marked dead."""
    token = uuid.uuid4().hex
    mark = run_dir / f".dew-shared-{token}"
    mark.write_text(token)
    check = ray.remote(_node_check)

    def ask(node: str):
        # max_retries=0: a lost check is asked again here, where a node that left is passed over
        where = NodeAffinitySchedulingStrategy(node, soft=False)
        return check.options(num_cpus=0, max_retries=0, scheduling_strategy=where).remote(str(run_dir), token)

    try:
        asked = {node: ask(node) for node in nodes}
        deadline = time.monotonic() + timeout
        for node, ref in asked.items():
            problem = _answer(node, ref, deadline, ask, timeout)
            if problem is not None:
                raise PreflightError(
                    f"the run directory {run_dir} is not shared with node {node[:8]} ({nodes[node]}): {problem}. "
                    "Every node the run uses must read and write one run directory at the same path (a network "
                    "filesystem mounted on every node); set run_dir to such a path")
    finally:
        mark.unlink(missing_ok=True)


def _answer(node: str, ref, deadline: float, ask: Callable, timeout: float) -> str | None:
    """One node's check: None when it passed or the node has left the cluster, else what failed."""
    failed = None  # Ray's last error for this node's check
    while True:
        try:
            return ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
        except GetTimeoutError:
            before = f"; before that it failed ({failed})" if failed else ""
            return f"its check did not finish within {timeout:g} s{before}"
        except RayError as error:  # the task could not run there, or was lost with its worker or node
            if node not in alive_nodes():
                return None
            failed = f"{type(error).__name__}: {str(error)[:300]}"
            if time.monotonic() >= deadline:
                return f"its check failed ({failed})"
            time.sleep(1.0)
            ref = ask(node)


def check_sandbox(runner: str, image: str = CONTAINER_IMAGE):
    """Start one program in the configured sandbox now; returns the runner, which the sandbox actors get."""
    try:
        made = sandbox_runner(runner, image)
    except RuntimeError as error:
        raise PreflightError(f"the sandbox for code tasks cannot start here: {error}") from None
    outcome = made.run(Program(argv=["python3", "-c", "print(1)"]), SandboxLimits(wall_seconds=30))
    if outcome.verdict is not Verdict.COMPLETED:
        raise PreflightError(f"the {runner} sandbox could not run a program ({outcome.verdict.value}, exit "
                             f"{outcome.exit_code}): {outcome.stderr.strip()[-500:]}")
    return made


def describe_runner(runner) -> str:
    """Which sandbox runs the code tasks, for the first lines a run prints."""
    if isinstance(runner, (BwrapRunner, ContainerRunner)):
        return runner.describe()
    return "ProcessRunner (no isolation: trusted code only)"


def start_ray(address: str | None, cpus_reserved: float) -> None:
    """Attach to ``address`` (or RAY_ADDRESS), or start a local cluster for this run."""
    # RAY_AUTH_MODE is left to the user and to Ray: a local cluster Ray starts turns token authentication on
    # (its raylets and GCS listen on every interface, loopback address or not), and an existing cluster's mode
    # is the one it was started with (RAY_AUTH_MODE=token and the token in ~/.ray/auth_token or RAY_AUTH_TOKEN).
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        check_packaged_temp_dir()
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        return
    # "local": a cluster of the run's own. A bare ray.init() attaches to the last cluster `ray start` began on this
    # machine (Ray's /tmp/ray/ray_current_cluster, left behind when that cluster died too), which is not the run
    # this command promises. A local cluster gets as many logical CPUs as the run reserves (at least the machine's
    # cores): they are scheduling tokens, and the roles share the cores as any processes do.
    cpus = max(os.cpu_count() or 1, math.ceil(cpus_reserved))
    # Its workers (trainers, rollout servers) start with glibc's huge pages for malloc (dew.hugepages: XLA's
    # per-step allocations otherwise fault in 4 KB at a time); on a cluster one attaches to, its `ray start`
    # environment decides (cluster_configs/ray-cluster.yaml sets it). They start from this interpreter, which has
    # dew-ray installed, with nothing packaged (see the module docstring).
    uv_hook, ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV, False
    try:
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                 configure_logging=False, runtime_env={"env_vars": hugepage_environment()})
    finally:
        ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = uv_hook


def check_packaged_temp_dir(environ=os.environ, cwd: Path | None = None) -> None:
    """Refuse a Ray temp dir (``RAY_TMPDIR``) inside the working directory Ray's uv hook will package: the package
    would hold the session's own files as they grow (a run zipped itself until its disk was full)."""
    if not ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV or not _get_uv_run_cmdline():
        return  # nothing is packaged
    temp = environ.get("RAY_TMPDIR")
    cwd = (cwd or Path.cwd()).resolve()
    if temp and Path(temp).expanduser().resolve().is_relative_to(cwd):
        raise PreflightError(f"RAY_TMPDIR ({Path(temp).expanduser().resolve()}) is inside the working directory "
                             f"{cwd}, which Ray packages for the cluster's workers under `uv run`: the package would "
                             "hold the Ray session's own files as they grow. Put the temp dir outside it (the default "
                             "is /tmp/ray)")


def pipeline_main(argv: list[str] | None, description: str, config_help: str, read_config: Callable,
                  run: Callable, report: Callable[[dict], None]) -> int:
    """Parse ``--config/--set/--address``, read the config (``read_config(path, overrides)``), run it, report."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help=config_help)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one field")
    parser.add_argument("--address", default=None, help="attach to this Ray cluster (default: RAY_ADDRESS or a "
                                                        "local cluster started for the run)")
    args = parser.parse_args(argv)
    try:
        config = read_config(args.config, args.set)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        summary = run(config, args.address)
    except PreflightError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    report(summary)
    return 0
