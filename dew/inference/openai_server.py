"""Rollouts from a vLLM or SGLang ``/v1/completions`` endpoint through the official ``openai`` client.

``OpenAICompletion(name, client, provider="vllm" | "sglang")`` posts token-id prompts (one
row of ids, or a list of rows) with ``client.completions.create`` (``client`` is an
``openai.OpenAI``; dew only calls it) and returns a :class:`Completion` whose choices hold
the sampled ids and their log-probabilities when the engine reports them. The field that
makes each engine return ids differs, and so does where they come back:

- vLLM (``entrypoints/openai/completion/protocol.py`` and ``serving.py`` in 0.32):
  ``return_tokens_as_token_ids`` renders each sampled id into ``logprobs.tokens`` as
  ``"token_id:<id>"`` beside ``logprobs.token_logprobs``; ``routed_experts`` is per
  choice, base64 of an ``.npy`` array;
- SGLang (``python/sglang/srt/entrypoints/openai/serving_completions.py``,
  ``_build_completion_response``): ``return_token_ids`` lists them on the choice as
  ``token_ids``; ``logprobs.token_logprobs`` as OpenAI's.

``OpenAIRolloutServer(completion, sampling, weights, processed_logprobs=False, routing=False)``
is the RolloutServer over one. The two engines report different distributions, so each
refuses the Sampling it cannot report, when it is built:

- vLLM reports raw model log-probabilities unless started with ``--logprobs-mode
  processed_logprobs``: a transforming Sampling (temperature other than 1) needs
  ``processed_logprobs=True``; a filtering one (top-k, top-p, min-p) needs each draw's
  kept ids, which only the token route returns: use :class:`~dew.inference.vllm_generate_server.VLLMGenerateServer`;
- SGLang's ``/v1/completions`` reports ``log_softmax(logits / temperature)`` before its
  filters and has no field for the filtered likelihood: any temperature, no filter.

``routing=True`` reads vLLM's per-choice ``routed_experts`` (start vLLM with
``--enable-return-routed-experts``). SGLang honours the seed only under
``--enable-deterministic-inference``; leave ``SGLANG_RETURN_ORIGINAL_LOGPROB`` unset, since it
switches SGLang to raw log-probabilities. The first request checks ``GET /v1/models``, so a
model name the engine does not serve fails naming the engine and the names it serves.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import numpy as np
import openai

from dew.inference.publisher import WeightPublisher
from dew.inference.engine_rollout_server import EngineRolloutServer, decode_routed_experts, sampling_params
from dew.inference.rollout_server import Draw
from dew.inference.wire import EngineError, EngineUnreachable, api_key
from dew.records.actions import token_ids
from dew.sampling import Sampling
from dew.validation import one_of

PROVIDERS = ("vllm", "sglang")


def engine_client(url: str):
    """The official ``openai`` client for an engine's root URL (``http://host:port``): the key :func:`authorize`
    gave that engine (none otherwise), no retries (a failed request is the rollout's to report, not the client's
    to repeat)."""
    return openai.OpenAI(base_url=f"{url.rstrip('/')}/v1", api_key=api_key(url) or "none", max_retries=0)
ID_FIELD = {"vllm": "return_tokens_as_token_ids", "sglang": "return_token_ids"}


def failure(error: Exception, message: str) -> EngineError:
    """The EngineError for the client's ``error``: EngineUnreachable when no answer came (the connection failed or
    broke, or timed out), as ``wire.call`` says it."""
    if isinstance(error, openai.APIConnectionError):
        return EngineUnreachable(message, timed_out=isinstance(error, openai.APITimeoutError))
    return EngineError(message)


@dataclasses.dataclass(frozen=True)
class CompletionChoice:
    """One choice: the sampled ids and their log-probabilities (None where the engine reported none)."""

    index: int
    token_ids: list[int] | None
    log_probs: list[float] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    routed_experts: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Completion:
    """An engine's answer to one completions request, choice by choice (prompt-major, then ``n``)."""

    choices: list[CompletionChoice]
    model: str


class OpenAICompletion:
    """Token-id completions from one served model of a vLLM or SGLang engine (see the module docstring)."""

    def __init__(self, name: str, client, provider: str = "vllm"):
        one_of("provider", provider, PROVIDERS)
        if not hasattr(client, "completions"):
            raise TypeError(f"client must be an openai.OpenAI (or one like it), got {type(client).__name__}")
        self.name, self.client, self.provider = name, client, provider
        self._checked = threading.Event()

    @property
    def url(self) -> str:
        return str(getattr(self.client, "base_url", "the engine")).rstrip("/")

    def at(self, root: str) -> OpenAICompletion:
        """The same served model at the engine root ``root`` (through :func:`engine_client`)."""
        return OpenAICompletion(self.name, engine_client(root), self.provider)

    def check(self) -> None:
        """Raise unless the engine answers ``/v1/models`` and serves ``name``."""
        try:
            served = [model.id for model in self.client.models.list()]
        except Exception as error:  # the client's own errors: connection, status
            raise failure(error, f"{self.url}: GET /models failed ({type(error).__name__}: {error})") from None
        if self.name not in served:
            raise EngineError(f"{self.url}: the engine does not serve model {self.name!r}; it serves {served}")
        self._checked.set()

    def create(self, prompt: Sequence[int] | Sequence[Sequence[int]], *, max_tokens: int, n: int = 1,
               timeout: float | None = None, **controls) -> Completion:
        """One ``/v1/completions`` request for one row of ids or a list of rows; ``controls`` go in the body."""
        rows = [prompt] if prompt and not isinstance(prompt[0], Sequence) else prompt
        rows = [list(token_ids(f"prompt[{i}]", row, nonempty=True)) for i, row in enumerate(rows)]
        if not self._checked.is_set():
            self.check()
        standard = {k: controls.pop(k) for k in ("temperature", "top_p", "seed", "logprobs", "stop") if k in controls}
        extra = {**controls, ID_FIELD[self.provider]: True}
        try:
            answer = self.client.completions.create(
                model=self.name, prompt=rows[0] if len(rows) == 1 else rows, max_tokens=max_tokens, n=n,
                extra_body=extra, timeout=timeout, **standard)
        except Exception as error:  # openai's APIStatusError / APIConnectionError, named with the engine
            status = getattr(error, "status_code", None)
            raise failure(error, f"{self.url}: /completions failed{f' with HTTP {status}' if status else ''} "
                                 f"({error})") from None
        data = answer.model_dump() if hasattr(answer, "model_dump") else dict(answer)
        return Completion(choices=[self._choice(c) for c in data.get("choices") or []], model=data.get("model", ""))

    def _choice(self, choice: dict) -> CompletionChoice:
        logprobs = choice.get("logprobs") or {}
        values = logprobs.get("token_logprobs")
        if self.provider == "vllm":
            ids = [_vllm_id(self.url, token) for token in logprobs.get("tokens") or []] if values is not None else None
        else:
            ids = choice.get("token_ids")
        return CompletionChoice(
            index=int(choice.get("index", 0)), token_ids=ids, log_probs=values,
            finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"),
            routed_experts=decode_routed_experts(self.url, choice.get("routed_experts")),
        )


def _vllm_id(url: str, token: str) -> int:
    if not isinstance(token, str) or not token.startswith("token_id:"):
        raise EngineError(
            f"{url}: logprobs.tokens holds {token!r}, not 'token_id:<id>'; vLLM renders ids so only with "
            "return_tokens_as_token_ids (is this engine vLLM?)"
        )
    return int(token.removeprefix("token_id:"))


class OpenAIRolloutServer(EngineRolloutServer):
    """A RolloutServer over an :class:`OpenAICompletion` (see the module docstring for the refusals)."""

    def __init__(self, completion: OpenAICompletion, sampling: Sampling, weights: WeightPublisher,
                 processed_logprobs: bool = False, routing: bool = False, workers: int = 64, timeout: float = 600.0):
        if not isinstance(completion, OpenAICompletion):
            raise TypeError(f"completion must be an OpenAICompletion, got {type(completion).__name__}")
        root = completion.url.removesuffix("/v1")  # the client's base URL is the engine's /v1
        super().__init__(completion.url, sampling, weights, workers, root=root)
        filters = [f"{name}={getattr(sampling, name)}" for name in ("top_k", "top_p", "min_p")
                   if getattr(sampling, name) is not None]
        if completion.provider == "vllm":
            if filters:
                raise ValueError(
                    f"{self.url}: a filtering Sampling ({', '.join(filters)}) needs each draw's kept ids, which only "
                    "vLLM's token route returns: use VLLMGenerateServer"
                )
            if sampling.temperature != 1 and not processed_logprobs:
                raise ValueError(
                    f"{self.url}: vLLM reports raw model log-probabilities, not those of temperature="
                    f"{sampling.temperature}; start it with --logprobs-mode processed_logprobs and pass "
                    "processed_logprobs=True"
                )
        else:
            if filters:
                raise ValueError(
                    f"{self.url}: SGLang's /v1/completions reports log-probabilities before its filters "
                    f"({', '.join(filters)}) and has no field for the filtered likelihood; only temperature is allowed"
                )
            if routing:
                raise ValueError(f"{self.url}: routing=True reads vLLM's per-choice routed_experts; SGLang has none")
        self.completion, self.processed_logprobs, self.routing, self.timeout = (
            completion, processed_logprobs, routing, timeout)

    def _moved(self, root: str) -> None:
        self.completion = self.completion.at(root)

    def _draw(self, prompt, max_new_tokens, seed, version) -> Draw:
        params = sampling_params(self.sampling, max_new_tokens, seed)
        max_tokens = params.pop("max_tokens")
        answer = self.completion.create(prompt, max_tokens=max_tokens, timeout=self.timeout, **params)
        if len(answer.choices) != 1:
            raise EngineError(f"{self.url}: expected one choice, got {len(answer.choices)}")
        choice = answer.choices[0]
        if choice.token_ids is None:
            raise EngineError(
                f"{self.url}: the engine answered without token ids; {self.completion.provider} returns them with "
                f"{ID_FIELD[self.completion.provider]} and logprobs=0"
            )
        if self.routing and choice.routed_experts is None:
            raise EngineError(f"{self.url}: routing=True but the choice has no routed_experts; start vLLM with "
                              "--enable-return-routed-experts")
        return self._finish(choice.token_ids, choice.log_probs, choice.finish_reason, version,
                            routed_experts=choice.routed_experts if self.routing else None)
