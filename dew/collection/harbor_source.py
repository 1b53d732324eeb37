"""HarborSource: each sample one Harbor trial whose harness calls the policy through a recording gateway.

``HarborSource(Gateway(url, sandbox_url=...), harbor=..., model=..., trials=N)`` is a
:class:`~dew.records.session_records.SessionSource`. For each sample it opens a gateway session,
runs ``harbor(trial)`` on one of ``trials`` worker threads, where the :class:`Trial`
carries the task, the session id, the harness's OpenAI base URL
(``{sandbox_url}/sessions/{session}/v1``) and the served model name, then reads the
session's calls back from the gateway's traces and deletes them there. ``harbor`` is
:class:`HarborCLI` (Harbor's own ``harbor trials start``) or any callable that runs a
harness the same way and returns a :class:`TrialOutcome`.

Each trace becomes a :class:`~dew.records.session_records.Call` with the exact ids the engine
read and sampled (``prompt_token_ids``, ``completion_token_ids``: rllm-model-gateway asks
every call for ``return_token_ids`` and ``logprobs``) and the engine's behaviour
log-probabilities, checked by the one action validator (``check_call``); its version is
the trace's ``weight_version`` (stamped by a gateway with ``/admin/weight_version``) or,
for a gateway that stamps nothing (rllm-model-gateway 0.1.0), the version ``served``
reported when the session was submitted, which can only overstate a call's lag.

Statuses: the outcome's "completed", "agent_error" and "truncated" become COMPLETED,
AGENT_ERROR and TRUNCATED with the verifier's reward. A trial that raised, reported
"error", or whose traces miss ids or log-probabilities, or a completed trial that made
no call through the gateway (a dead worker makes the gateway answer 500 and record
nothing), becomes INFRA_ERROR with a detail saying which; the scheduler resubmits those.
No session carries an id or likelihood the engine did not report. The gateway is checked
once before the first submission (``Gateway.ready(ready_timeout)``); a gateway that is
not ready raises from ``submit``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dew.inference.gateway import Gateway
from dew.records.actions import check_call
from dew.records.session_records import Call, Session, SessionSource, Status, Task
from dew.validation import positive_int

OUTCOMES = {"completed": Status.COMPLETED, "agent_error": Status.AGENT_ERROR, "truncated": Status.TRUNCATED,
            "error": Status.INFRA_ERROR}
# Harbor's exception types that say the agent ran and failed, not the infrastructure (harbor 0.25, trial/result.py).
AGENT_EXCEPTIONS = frozenset({"AgentTimeoutError", "NonZeroAgentExitCodeError", "ContextLengthExceededError",
                              "OutputLengthExceededError"})


@dataclasses.dataclass(frozen=True)
class Trial:
    """One harness run: the task, the gateway session and where the harness reaches the model."""

    task: Task
    session: str
    base_url: str
    model: str


@dataclasses.dataclass(frozen=True)
class TrialOutcome:
    """What a harness reports: ``status`` ("completed", "agent_error", "truncated" or "error"), the reward."""

    status: str
    reward: float | None = None
    components: Mapping[str, float] = dataclasses.field(default_factory=dict)
    detail: str = ""


def trace_call(trace: Mapping[str, Any], index: int, fallback_version: int | None,
               eos_ids: Sequence[int] = ()) -> Call:
    """The Call one gateway trace records; ValueError naming the trace and the missing field otherwise.

    ``fallback_version`` labels a trace the gateway did not stamp; None refuses such a trace."""
    where = f"trace {index} ({trace.get('trace_id', '?')})"
    prompt, sampled = trace.get("prompt_token_ids") or [], trace.get("completion_token_ids")
    log_probs = trace.get("logprobs")
    if not prompt:
        raise ValueError(f"{where} has no prompt_token_ids: the engine did not return the ids it read "
                         "(vLLM's return_token_ids)")
    if sampled is None or log_probs is None:
        raise ValueError(f"{where} has no {'completion_token_ids' if sampled is None else 'logprobs'}: the engine did "
                         "not report what it sampled")
    version = trace.get("weight_version", (trace.get("metadata") or {}).get("weight_version", fallback_version))
    if version is None:
        raise ValueError(f"{where} has no weight_version and the source has no served publisher to label it; "
                         "pass served= or stamp the gateway")
    reason = {"tool_calls": "stop"}.get(trace.get("finish_reason"), trace.get("finish_reason") or "stop")
    call = Call(prompt_ids=list(prompt), sampled_ids=list(sampled), behavior_log_probs=list(log_probs),
                finish_reason=reason, version=int(version))
    check_call(where, call, eos_ids)
    return call


class HarborSource(SessionSource):
    """Harbor trials through a recording gateway as sessions (see the module docstring).

    ``served`` is the publisher whose ``version`` labels calls a gateway does not stamp;
    ``eos_ids`` are checked against each call's finish reason when given.
    """

    def __init__(self, gateway: Gateway, harbor: Callable[[Trial], TrialOutcome], model: str, trials: int = 8, *,
                 served=None, eos_ids: Sequence[int] = (), ready_timeout: float = 60.0):
        if not isinstance(gateway, Gateway):
            raise TypeError(f"gateway must be a dew Gateway, got {type(gateway).__name__}")
        if not callable(harbor):
            raise TypeError(f"harbor must be callable as harbor(trial) -> TrialOutcome, got {type(harbor).__name__}")
        self.gateway, self.harbor, self.model, self.served = gateway, harbor, model, served
        self.eos_ids, self.ready_timeout = tuple(eos_ids), ready_timeout
        self._pool = ThreadPoolExecutor(positive_int("trials", trials), thread_name_prefix="harbor-trial")
        self._ready = False
        self._lock = threading.Lock()

    def submit(self, task: Task, group: int, samples: int) -> list[Future]:
        with self._lock:
            if not self._ready:
                self.gateway.ready(self.ready_timeout)
                self._ready = True
        version = int(self.served.version) if self.served is not None else None
        return [self._pool.submit(self._session, task, group, sample, version) for sample in range(samples)]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _session(self, task: Task, group: int, sample: int, version: int | None) -> Session:
        session = Session(task=task, group=group, sample=sample, attempt=0, calls=[], status=Status.INFRA_ERROR)
        name = f"{_token(task.id)}-g{group}-s{sample}-{uuid.uuid4().hex[:12]}"
        try:
            base_url = self.gateway.open(name)
        except Exception as error:  # the gateway went away: retried like any infrastructure failure
            session.detail = f"opening gateway session {name} failed: {error}"
            return session
        try:
            outcome = self.harbor(Trial(task, name, base_url, self.model))
        except Exception as error:
            outcome = TrialOutcome("error", detail=f"the trial raised {type(error).__name__}: {error}")
        try:
            traces = self.gateway.traces(name)
            self.gateway.close_session(name)
        except Exception as error:
            session.detail = f"reading the traces of gateway session {name} failed: {error}"
            return session
        return _finished(session, outcome, traces, version, self.eos_ids, name)


def _finished(session: Session, outcome: TrialOutcome, traces: list[dict], version: int | None,
              eos_ids: Sequence[int], name: str) -> Session:
    status = OUTCOMES.get(outcome.status) if isinstance(outcome, TrialOutcome) else None
    if status is None:
        session.detail = f"the harness returned {outcome!r:.200}, not a TrialOutcome with a known status"
        return session
    if status is Status.INFRA_ERROR:
        session.detail = outcome.detail or "the trial reported an error"
        return session
    try:
        calls = [trace_call(trace, index, version, eos_ids) for index, trace in enumerate(traces)]
    except ValueError as error:
        session.detail = f"gateway session {name}: {error}"
        return session
    if not calls:
        session.detail = (f"gateway session {name} recorded no model call (a gateway with no healthy worker answers "
                          "500 and records nothing)")
        return session
    reward = outcome.reward
    if status is not Status.TRUNCATED and (reward is None or not math.isfinite(reward)):
        session.detail = f"the trial finished {outcome.status} without a finite reward ({reward!r})"
        return session
    session.calls, session.status, session.reward = calls, status, reward
    session.components, session.detail = dict(outcome.components), outcome.detail
    return session


def _token(text: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "_-" else "-" for c in str(text))
    return cleaned[:64] or "task"


class HarborCLI:
    """One Harbor trial per call, run with Harbor's own command line (``harbor trials start``).

    ``harbor`` is the Harbor executable (Harbor needs Python >= 3.12, so it usually lives
    in an environment of its own); the task's Harbor task directory is ``tasks / task.data
    ["harbor_task"]`` (or ``tasks / task.id``). The agent reaches the model through Harbor's
    ``--base-url <trial base URL>`` as ``openai/<model>``, and ``allow_hosts`` go to
    ``--allow-agent-host`` for a task whose agent phase runs with ``network_mode =
    "allowlist"``. ``args`` are added as they are (for example ``["--env", "daytona"]``, or
    ``["--env", "dew_harbor.docker:DockerEnvironment"]`` where no registry serves Harbor's own
    images, ``["--env", "dew_harbor.bubblewrap:BubblewrapEnvironment"]`` on a machine without
    containers); ``env`` adds environment variables for Harbor's process. The outcome comes from the trial's
    ``result.json``: ``verifier_result.rewards["reward"]`` (the other rewards are the
    components), ``exception_info`` an agent error or an infrastructure error by its type.
    """

    def __init__(self, tasks, trials_dir, *, harbor: str = "harbor", agent: str = "terminus-2",
                 allow_hosts: Sequence[str] = (), args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 timeout: float = 3600.0):
        self.tasks, self.trials_dir = Path(tasks), Path(trials_dir)
        self.harbor, self.agent, self.allow_hosts, self.args = harbor, agent, tuple(allow_hosts), tuple(args)
        self.env, self.timeout = dict(env or {}), timeout

    def command(self, trial: Trial) -> list[str]:
        task = self.tasks / str(trial.task.data.get("harbor_task", trial.task.id))
        command = [self.harbor, "trials", "start", "--path", str(task), "--trials-dir", str(self.trials_dir),
                   "--trial-name", trial.session, "--agent", self.agent, "--model", f"openai/{trial.model}",
                   "--base-url", trial.base_url]
        for host in self.allow_hosts:
            command += ["--allow-agent-host", host]
        return command + list(self.args)

    def __call__(self, trial: Trial) -> TrialOutcome:
        try:
            finished = subprocess.run(self.command(trial), capture_output=True, text=True, timeout=self.timeout,
                                      env={**os.environ, **self.env})
        except subprocess.TimeoutExpired:
            return TrialOutcome("error", detail=f"harbor did not finish the trial within {self.timeout:.0f} s")
        except OSError as error:
            return TrialOutcome("error", detail=f"harbor could not be started ({error})")
        result = self.trials_dir / trial.session / "result.json"
        if not result.is_file():
            tail = (finished.stderr or finished.stdout or "").strip()[-600:]
            return TrialOutcome("error", detail=f"harbor exited {finished.returncode} without {result}: {tail}")
        return outcome_of(json.loads(result.read_text()))


def outcome_of(result: Mapping[str, Any]) -> TrialOutcome:
    """A Harbor ``TrialResult`` (its ``result.json``) as a TrialOutcome."""
    error = result.get("exception_info")
    rewards = dict((result.get("verifier_result") or {}).get("rewards") or {})
    reward = rewards.pop("reward", None)
    if error:
        kind = error.get("exception_type", "?")
        detail = f"{kind}: {error.get('exception_message', '')}"[:600]
        if kind not in AGENT_EXCEPTIONS or reward is None:
            return TrialOutcome("error", detail=detail)
        return TrialOutcome("agent_error", float(reward), rewards, detail)
    if reward is None:
        return TrialOutcome("error", detail="the trial finished without a verifier reward")
    return TrialOutcome("completed", float(reward), {k: float(v) for k, v in rewards.items()})
