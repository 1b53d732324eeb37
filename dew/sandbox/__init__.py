"""Sandboxed execution: programs, limits, runners, the fleet, SubprocessEnvironment and verifiable rewards."""

from dew.sandbox.subprocess_environment import SubprocessEnvironment, WorkerEnvironment
from dew.sandbox.fleet import SandboxFleet
from dew.sandbox.program import Outcome, Program, SandboxLimits, Verdict
from dew.sandbox.verifiable_rewards import CodeReward, GSM8KReward, LastNumberReward, MathReward
from dew.sandbox.runners import BwrapRunner, ProcessRunner, Runner, default_runner
from dew.sandbox.container_runner import ContainerRunner

__all__ = [
    "BwrapRunner",
    "CodeReward",
    "GSM8KReward",
    "ContainerRunner",
    "default_runner",
    "LastNumberReward",
    "MathReward",
    "Outcome",
    "ProcessRunner",
    "Program",
    "Runner",
    "SandboxFleet",
    "SandboxLimits",
    "SubprocessEnvironment",
    "Verdict",
    "WorkerEnvironment",
]
