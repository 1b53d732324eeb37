"""Rollout servers whose tokens come from an engine in another process: the base they share.

:class:`EngineRolloutServer` is what every remote server does alike: a request per draw on
a thread pool, the draw's version read from ``weights`` when it is submitted (a push that
lands while the request runs leaves it at the older version, the oldest weights that may
have produced any of its tokens), ``load`` through ``weights``, cancellation that resolves
the future at once, and the checks of what came back (ids and log-probabilities of one
length, finite, in the vocabulary's range). Remote draws carry no raw likelihood
(``old_log_probs`` is None): the trainer rescores them.

Its subclasses: :class:`~dew.inference.openai_server.OpenAIRolloutServer` (vLLM or SGLang
``/v1/completions``) and :class:`~dew.inference.vllm_generate_server.VLLMGenerateServer`
(vLLM's token route).
"""

from __future__ import annotations

import abc
import base64
import io
import itertools
import math
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dew.inference.publisher import WeightPublisher
from dew.inference.rollout_server import Draw, DrawFuture, RolloutServer, ServerDied, settle
from dew.inference.wire import EngineError, EngineUnreachable, call
from dew.records.actions import token_ids
from dew.sampling import Sampling
from dew.validation import positive_int


class PublishedRolloutServer(RolloutServer):
    """A RolloutServer whose weights and version are another publisher's (``self.weights``)."""

    weights: WeightPublisher

    @property
    def version(self) -> int:
        return self.weights.version

    def load(self, variables, version: int) -> None:
        self.weights.load(variables, version)


class EngineRolloutServer(PublishedRolloutServer):
    """A RolloutServer over an engine in another process (see the module docstring).

    Subclasses give ``_draw(prompt, max_new_tokens, seed, version) -> Draw``, run on one
    of ``workers`` threads; ``url`` names the engine in every error; ``root`` is the
    engine's root URL (default ``url``), where :meth:`probe` asks ``/health``. ``died``
    turns true when the engine refuses a draw's connection (its process is gone), before
    that draw's future is set, so a pool never chooses it again (and false when it answers
    ``/health`` again). A draw that gets no answer because the connection failed or broke (the
    engine is gone, or went during the draw) fails as :class:`ServerDied`, which callers draw
    again on another server; one that timed out or was answered with an error fails as the
    EngineError saying so. :meth:`move` points the server at the engine's new root when its host
    started it again elsewhere.
    """

    def __init__(self, url: str, sampling: Sampling, weights: WeightPublisher, workers: int = 64,
                 root: str | None = None):
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a dew.sampling.Sampling, got {type(sampling).__name__}")
        if not isinstance(weights, WeightPublisher):
            raise TypeError(
                f"weights must be a WeightPublisher (a Publication over the engines' push), got {type(weights).__name__}"
            )
        positive_int("workers", workers)
        self.url, self.sampling, self.weights = url, sampling, weights
        self.root = (root or url).rstrip("/")
        self.died = False
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="dew-remote-rollout")
        self._numbers = itertools.count()
        self._closed = threading.Event()

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int = 0) -> DrawFuture:
        if self._closed.is_set():
            raise RuntimeError(f"the rollout server for {self.url} is closed")
        prompt = list(token_ids("prompt_ids", prompt_ids, nonempty=True))
        positive_int("max_new_tokens", max_new_tokens)
        future = DrawFuture()
        future.request = next(self._numbers)
        version = self.weights.version  # read before the request leaves: never newer than its tokens

        def run():
            try:
                if future.done():  # cancelled while it waited for a thread
                    return
                draw = self._draw(prompt, max_new_tokens, int(seed), version)
            except BaseException as error:  # the caller learns why from the future
                if refused(error):
                    self.died = True
                if isinstance(error, EngineUnreachable) and not error.timed_out:  # gone, or went during the draw
                    gone = ServerDied(f"{error}; the engine is gone: its draws go to the others")
                    gone.__cause__ = error
                    error = gone
                settle(future, error=error)
            else:
                settle(future, draw)

        self._pool.submit(run)
        return future

    def probe(self, timeout: float | None) -> bool | None:
        """True when the engine answers ``GET /health`` within ``timeout`` seconds, None when it answers nothing;
        ServerDied when it is gone (it refuses the connection, or reports itself unhealthy)."""
        try:
            status, _ = call(f"{self.root}/health", method="GET", timeout=timeout)
        except EngineUnreachable as error:
            if error.timed_out:
                return None
            self.died = True
            raise ServerDied(str(error)) from None
        if status != 200:
            self.died = True
            raise ServerDied(f"{self.root}: /health answered HTTP {status}: the engine reports itself unhealthy")
        self.died = False
        return True

    def move(self, root: str) -> None:
        """Draw from the engine at ``root`` from now on (the same engine, started again at another address); draws
        already sent to the old address end as they will there."""
        root = root.rstrip("/")
        self.url = root + self.url[len(self.root):]  # the route under the root stays (OpenAI's /v1)
        self.root = root
        self._moved(root)
        self.died = False

    def _moved(self, root: str) -> None:
        """What a subclass holds of the engine's address besides ``url`` and ``root`` (a client), made anew."""

    def cancel(self, draw: DrawFuture) -> None:
        """Resolve ``draw`` as cancelled now; a request already at the engine runs to its end there, unread."""
        settle(draw, Draw(ids=[], behavior_log_probs=[], old_log_probs=None, eos=False,
                                version=self.weights.version, finish_reason="cancelled"))

    def close(self) -> None:
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    @abc.abstractmethod
    def _draw(self, prompt: list[int], max_new_tokens: int, seed: int, version: int) -> Draw: ...

    def _finish(self, ids, log_probs, finish_reason, version, *, support=None, routed_experts=None) -> Draw:
        """The checked Draw of one engine answer (raises EngineError naming what is wrong with it)."""
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise EngineError(f"{self.url}: the engine answered without the sampled token ids (got {ids!r:.120})")
        if not isinstance(log_probs, list) or len(log_probs) != len(ids):
            raise EngineError(
                f"{self.url}: the engine reported {len(log_probs) if isinstance(log_probs, list) else 'no'} "
                f"log-probabilities for {len(ids)} sampled ids; every drawn token needs its behaviour likelihood"
            )
        bad = [p for p in log_probs if not isinstance(p, (int, float)) or not math.isfinite(p) or p > 1e-4]
        if bad:
            raise EngineError(f"{self.url}: the engine reported log-probabilities that are not finite and <= 0: {bad[:5]}")
        eos_ids = self.sampling.eos_ids
        eos = finish_reason == "stop" and (not eos_ids or bool(ids and ids[-1] in eos_ids))
        reason = finish_reason if finish_reason in ("stop", "length") else "abort"
        return Draw(ids=ids, behavior_log_probs=[float(p) for p in log_probs], old_log_probs=None, eos=eos,
                    version=version, finish_reason=reason, support=support, routed_experts=routed_experts)


def refused(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from or during) is a refused connection: the engine is gone."""
    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, ConnectionRefusedError) or isinstance(getattr(error, "reason", None),
                                                                   ConnectionRefusedError):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def decode_routed_experts(url: str, value) -> np.ndarray | None:
    """vLLM's ``routed_experts`` (base64 of an ``.npy`` array, ``vllm.utils.serial_utils.numpy2base64``)."""
    if value is None:
        return None
    try:
        return np.load(io.BytesIO(base64.b64decode(value)), allow_pickle=False)
    except (ValueError, TypeError, OSError) as error:
        raise EngineError(f"{url}: routed_experts is not a base64 .npy array ({error})") from None


def sampling_params(sampling: Sampling, max_new_tokens: int, seed: int) -> dict:
    """The Sampling as the request controls vLLM and SGLang share (absent filters are left out)."""
    params = {"max_tokens": max_new_tokens, "temperature": sampling.temperature, "seed": seed, "logprobs": 0}
    for name in ("top_k", "top_p", "min_p"):
        if getattr(sampling, name) is not None:
            params[name] = getattr(sampling, name)
    if sampling.eos_ids:
        params["stop_token_ids"] = list(sampling.eos_ids)
    return params
