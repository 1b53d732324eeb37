"""Proof that a push landed: the engine scores a fixed probe and must agree with the trainer.

No engine says which weights it serves in a way a trainer can check (TRL #5312: vLLM kept
serving stale weights after sleep mode, noticed only from a logprob metric). A
:class:`LandingCheck` closes that gap: after a push, each replica scores a fixed probe
(its prompt log-probabilities), the trainer computes the same log-probabilities under the
weights it published, in float32 from the published precision, and any difference beyond
a tolerance set by the engine's compute precision fails the push, naming the replica, the
position and the largest difference.

How each engine scores the probe:

- vLLM: ``POST /v1/completions`` with ``prompt_logprobs: 0`` and ``max_tokens: 1``; the
  answer's ``choices[0].prompt_logprobs[i][str(id)]["logprob"]`` (entry 0 is null);
- SGLang: ``POST /generate`` with ``input_ids``, ``return_logprob: true`` and
  ``logprob_start_len: 0``; ``meta_info.input_token_logprobs`` holds ``[logprob, id, text]``
  per prompt token (SGLang's ``tokenizer_manager`` and ``http_server.generate_request``);
- the native server scores it with its own served copy (``Server.score``).

Tolerances (``TOLERANCE``) come from measurement on these CPUs (see the landing check
figures in docs/engines.md): float32 engines agree with dew to about 1e-6 nats, bfloat16
compute to a few hundredths; the defaults leave room above both and stay below what a changed layer
moves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dew.inference.wire import EngineError, expect
from dew.records.actions import token_ids
from dew.validation import one_of, positive

TOLERANCE = {"float32": 2e-3, "bfloat16": 0.1}
PROBE_LENGTH = 24


class LandingError(EngineError):
    """A replica does not serve the weights the trainer just published."""


def halved_down_proj(variables, layer: int = 0):
    """``variables`` with one layer's MLP down projection halved: the change the landing-check figures (docs/engines.md)
    measure the check against (a copy; ``variables`` is left alone)."""
    changed = jax.tree.map(lambda x: x, variables)  # new containers, shared leaves
    mlp = changed["params"][f"layers_{layer}"]["mlp"]
    mlp["down_proj"] = {**mlp["down_proj"], "kernel": np.asarray(mlp["down_proj"]["kernel"]) * 0.5}
    return changed


def probe_ids(vocab_size: int, length: int = PROBE_LENGTH, seed: int = 0) -> list[int]:
    """A fixed probe: ``length`` ids drawn once from ``seed`` (the same every push and every run)."""
    return np.random.default_rng(seed).integers(0, vocab_size, length).tolist()


class LandingCheck:
    """Compares an engine's probe log-probabilities with the trainer's (see the module docstring).

    ``model`` is the trainer's CausalTransformer; ``served_dtype`` the precision the engine
    computes in ("float32" or "bfloat16"), which sets ``tolerance`` unless given;
    ``published_dtype`` the precision the push wrote, to which the trainer's weights are
    rounded before scoring.
    """

    def __init__(self, model, probe: Sequence[int] | None = None, served_dtype: str = "bfloat16",
                 published_dtype: str = "bfloat16", tolerance: float | None = None):
        one_of("served_dtype", served_dtype, tuple(TOLERANCE))
        one_of("published_dtype", published_dtype, ("float32", "bfloat16"))
        self.model = model
        self.probe = list(token_ids("probe", probe if probe is not None else probe_ids(model.vocab_size), nonempty=True))
        if len(self.probe) < 2:
            raise ValueError("probe must hold at least two ids: the first one has no log-probability")
        if max(self.probe) >= model.vocab_size:
            raise ValueError(f"probe ids must be below the vocabulary size {model.vocab_size}, got {max(self.probe)}")
        self.served_dtype, self.published_dtype = served_dtype, published_dtype
        self.tolerance = positive("tolerance", tolerance) if tolerance is not None else TOLERANCE[served_dtype]
        self._score = jax.jit(_prompt_log_probs, static_argnums=0)  # compiled once per (model, dtypes)

    def expected(self, variables) -> np.ndarray:
        """The trainer's log-probabilities of ``probe[1:]`` under ``variables`` as published."""
        dtype = jnp.bfloat16 if self.published_dtype == "bfloat16" else jnp.float32
        published = jax.tree.map(lambda x: jnp.asarray(x).astype(dtype).astype(jnp.float32)
                                 if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating) else x, variables)
        return np.asarray(self._score(self.model, published, jnp.asarray([self.probe], jnp.int32)))

    def compare(self, replica: str, served: Sequence[float], expected: np.ndarray) -> float:
        """The largest difference; raises LandingError when it is beyond the tolerance."""
        served = np.asarray(served, np.float64)
        if served.shape != expected.shape:
            raise LandingError(f"{replica}: scored {served.shape[0]} probe positions, expected {expected.shape[0]}")
        gap = np.abs(served - expected)
        worst = int(np.argmax(gap))
        if not np.isfinite(gap[worst]) or gap[worst] > self.tolerance:
            raise LandingError(
                f"{replica}: does not serve the published weights: its log-probability of probe position {worst + 1} "
                f"(id {self.probe[worst + 1]}) is {served[worst]:.6f}, the trainer's {expected[worst]:.6f} "
                f"(difference {gap[worst]:.3g} > tolerance {self.tolerance:g} for {self.served_dtype} serving)"
            )
        return float(gap[worst])

    def served(self, model, variables) -> np.ndarray:
        """The probe's log-probabilities under a served copy (``model`` and ``variables`` in the served dtype)."""
        return np.asarray(self._score(model, variables, jnp.asarray([self.probe], jnp.int32)))

    def verify(self, replicas: Sequence[str], scorer: Callable[[str, list[int]], list[float]], variables) -> dict:
        """Score the probe on every replica and compare; ``{replica: largest difference}``."""
        expected = self.expected(variables)
        return {replica: self.compare(replica, scorer(replica, self.probe), expected) for replica in replicas}


def _prompt_log_probs(model, variables, ids):
    logits = model.apply(variables, ids).astype(jnp.float32)[0, :-1]
    return jnp.take_along_axis(jax.nn.log_softmax(logits), ids[0, 1:, None], axis=-1)[:, 0]


def vllm_prompt_log_probs(url: str, probe: list[int], timeout: float = 120.0) -> list[float]:
    """vLLM's log-probabilities of ``probe[1:]`` (the model named by its ``/v1/models``)."""
    models = expect(f"{url}/v1/models", method="GET", timeout=timeout)
    try:
        name = models["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise EngineError(f"{url}: /v1/models names no served model ({models!r:.200})") from None
    answer = expect(f"{url}/v1/completions", {"model": name, "prompt": probe, "max_tokens": 1, "temperature": 0,
                                              "prompt_logprobs": 0}, timeout=timeout)
    try:
        rows = answer["choices"][0]["prompt_logprobs"]
        return [float(rows[i][str(probe[i])]["logprob"]) for i in range(1, len(probe))]
    except (KeyError, IndexError, TypeError):
        raise EngineError(f"{url}: the answer has no prompt_logprobs for the probe ({answer!r:.200})") from None


def sglang_prompt_log_probs(url: str, probe: list[int], timeout: float = 120.0) -> list[float]:
    """SGLang's log-probabilities of ``probe[1:]`` from its native ``/generate``."""
    answer = expect(f"{url}/generate", {"input_ids": probe, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                                        "return_logprob": True, "logprob_start_len": 0}, timeout=timeout)
    try:
        rows = answer["meta_info"]["input_token_logprobs"]
        return [float(rows[i][0]) for i in range(1, len(probe))]
    except (KeyError, IndexError, TypeError):
        raise EngineError(f"{url}: the answer has no input_token_logprobs ({answer!r:.200})") from None


SCORERS = {"vllm": vllm_prompt_log_probs, "sglang": sglang_prompt_log_probs}
