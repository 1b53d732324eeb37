"""Sandboxed execution: programs, limits, runners, the fleet, SubprocessEnvironment and verifiable rewards."""

from dew.sandbox.environment import SubprocessEnvironment, WorkerEnvironment
from dew.sandbox.program import Outcome, Program, SandboxLimits, Verdict

__all__ = ["Outcome", "Program", "SandboxLimits", "SubprocessEnvironment", "Verdict", "WorkerEnvironment"]
