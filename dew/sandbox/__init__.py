"""Sandboxed execution: programs, limits, runners, the fleet, SubprocessEnvironment and verifiable rewards."""

from dew.sandbox.environment import SubprocessEnvironment, WorkerEnvironment
from dew.sandbox.program import Outcome, Program, SandboxLimits, Verdict
from dew.sandbox.rewards import CodeReward, MathReward

__all__ = ["CodeReward", "MathReward", "Outcome", "Program", "SandboxLimits", "SubprocessEnvironment", "Verdict", "WorkerEnvironment"]
