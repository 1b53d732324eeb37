"""Rollouts from vLLM's token route, with each drawn token's kept ids: :class:`VLLMGenerateServer`.

It posts to ``/inference/v1/generate`` (vLLM 0.32's
``entrypoints/scale_out/token_in_token_out``: ``GenerateRequest`` with ``token_ids`` and
``sampling_params``; each choice has ``token_ids``, ``logprobs.content[i].logprob``,
``sampling_mask`` and ``routed_experts``). With vLLM started with ``--enable-scale-out`` (or
``--tokens-only``), ``--return-sampling-mask`` and ``--logprobs-mode processed_logprobs``,
each drawn token comes back with the ids the sampler kept (its support), so a top-k or
top-p policy trains on its recorded support. vLLM builds the mask only under a finite top-k
(its input processor refuses ``top_k <= 0`` with the mask on), so the server refuses a
Sampling without one. What it shares with the other remote servers (threads, versions,
cancellation, the checks of an answer) is :class:`~dew.inference.engine_rollout_server.EngineRolloutServer`.
"""

from __future__ import annotations

from dew.inference.engine_rollout_server import EngineRolloutServer, decode_routed_experts, sampling_params
from dew.inference.publisher import WeightPublisher
from dew.inference.rollout_server import Draw
from dew.inference.wire import EngineError, expect
from dew.sampling import Sampling


class VLLMGenerateServer(EngineRolloutServer):
    """Draws from vLLM's token route with each token's kept ids (see the module docstring).

    ``base_url`` is the engine's root (``http://host:port``); ``routing=True`` reads each
    choice's ``routed_experts`` (start vLLM with ``--enable-return-routed-experts``).
    """

    def __init__(self, base_url: str, sampling: Sampling, weights: WeightPublisher, routing: bool = False,
                 model: str | None = None, workers: int = 64, timeout: float = 600.0):
        super().__init__(base_url.rstrip("/"), sampling, weights, workers)
        if sampling.top_k is None:
            raise ValueError(
                f"{self.url}: VLLMGenerateServer needs a Sampling with a finite top_k: vLLM builds the sampling mask "
                "(each token's kept ids) only under one"
            )
        if sampling.greedy:
            raise ValueError(f"{self.url}: vLLM's sampling mask needs temperature > 0; greedy draws have no support")
        self.routing, self.model, self.timeout = routing, model, timeout

    def _draw(self, prompt, max_new_tokens, seed, version) -> Draw:
        body = {"token_ids": prompt, "sampling_params": sampling_params(self.sampling, max_new_tokens, seed)}
        if self.model is not None:
            body["model"] = self.model
        rule = "start vLLM with --enable-scale-out (or --tokens-only) for /inference/v1/generate"
        answer = expect(f"{self.url}/inference/v1/generate", body, timeout=self.timeout, rule=rule)
        choice = _only_choice(self.url, answer)
        content = (choice.get("logprobs") or {}).get("content") or []
        mask = choice.get("sampling_mask")
        ids = choice.get("token_ids")
        if mask is None:
            raise EngineError(
                f"{self.url}: the answer has no sampling_mask; start vLLM with --return-sampling-mask and "
                "--logprobs-mode processed_logprobs (vLLM builds it only on its model runner V2)"
            )
        if not isinstance(mask, list) or len(mask) != len(ids or []):
            raise EngineError(f"{self.url}: sampling_mask has {len(mask) if isinstance(mask, list) else '?'} rows "
                              f"for {len(ids or [])} sampled ids")
        for position, (drawn, kept) in enumerate(zip(ids, mask)):
            if drawn not in kept:
                raise EngineError(f"{self.url}: token {position} ({drawn}) is not among the ids its sampling_mask kept")
        routed = decode_routed_experts(self.url, choice.get("routed_experts")) if self.routing else None
        if self.routing and routed is None:
            raise EngineError(f"{self.url}: routing=True but the answer has no routed_experts; start vLLM with "
                              "--enable-return-routed-experts")
        return self._finish(ids, [entry.get("logprob") for entry in content], choice.get("finish_reason"), version,
                            support=[list(kept) for kept in mask], routed_experts=routed)


def _only_choice(url: str, answer) -> dict:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise EngineError(f"{url}: expected one choice in the answer, got {answer!r:.200}")
    return choices[0]
