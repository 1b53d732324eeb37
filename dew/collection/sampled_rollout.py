"""``SampledRollout``: the trainer's rollout hook for single-turn GRPO with a reward function.

Called by the Trainer before each update with a ``Prompts`` batch (``prompt`` [B, P]
left-padded, ``prompt_length`` [B], UTF-8 byte columns ``data_source``,
``ground_truth``, ``extra_info``), the current variables, the policy version and a key,
it samples ``groups`` completions of up to ``max_new_tokens`` ids for every prompt
with the native :class:`~dew.inference.TextGeneration` (prompts prefilled once,
packed into each row's cache), scores every completion with

    reward(data_source: str, completion: str, ground_truth: str, extra_info: str) -> float

(``completion`` is ``decode`` of the sampled ids without EOS and padding; the default
``decode`` writes the ids separated by spaces), turns each completion into a one-call
:class:`~dew.records.session_records.Session` (COMPLETED on EOS, TRUNCATED on the budget,
both scored: ``truncation="score"``) and returns ``pack(...)`` of them with the raw
policy's ``old_log_probs``: every column ``[B * G, seq_len + 1]``, session ``b * G + g``
being prompt row ``b``'s completion ``g``. A reward or decode failure raises naming the
prompt row; nothing trains on a partial group.

``metrics`` holds the last batch's :func:`~dew.records.session_metrics.reward_metrics` (reward
mean and std, the share of groups with equal rewards, response lengths and the truncated
share, the mean per data source), ``reward/share_positive`` and ``response/eos_share``; a
Trainer logs them with each update as ``rollout/...``.

For the same recipe over any :class:`~dew.inference.RolloutServer`, as a
:class:`~dew.records.session_records.SessionSource` whose draws are scored on a thread
pool as each finishes, see :class:`~dew.collection.sources.PromptSource`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from dew.data.prompts import METADATA, metadata_texts, prompt_rows
from dew.records.session_metrics import reward_metrics
from dew.inference.generation import TextGeneration
from dew.collection.scoring import ScoringError, score_completion, token_text
from dew.losses.advantages import ESTIMATORS
from dew.records.session_packing import pack
from dew.records.session_records import Call, Session, Status, Task
from dew.sampling import Sampling
from dew.validation import integer, one_of, positive_int


class SampledRollout:
    """Sample, score and pack GRPO groups (see the module docstring)."""

    def __init__(
        self,
        objective,
        reward: Callable[[str, str, str, str], float],
        groups: int,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        decode: Callable[[list[int]], str] | None = None,
        estimator: str = "group",
    ):
        if not callable(reward):
            raise TypeError(f"reward must be callable as reward(data_source, completion, ground_truth, extra_info), got {reward!r}")
        integer("groups", groups, at_least=2, why="advantages compare completions of one prompt")
        positive_int("max_new_tokens", max_new_tokens)
        sampling = Sampling() if sampling is None else sampling
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a dew.sampling.Sampling, got {type(sampling).__name__}")
        one_of("estimator", estimator, ESTIMATORS)
        if decode is not None and not callable(decode):
            raise TypeError(f"decode must be callable on a list of ids, got {decode!r}")
        self.objective = objective
        self.reward = reward
        self.groups = groups
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.decode = decode or token_text
        self.estimator = estimator
        self.policy = TextGeneration(objective.model)
        self.metrics: dict[str, float] = {}

    def __call__(self, batch, variables, version: int, key: jax.Array) -> dict[str, np.ndarray]:
        prompts = prompt_rows(batch, "SampledRollout")
        vocab = getattr(self.objective.model, "vocab_size", None)
        for row, ids in enumerate(prompts):
            if vocab is not None and (min(ids) < 0 or max(ids) >= vocab):
                raise ValueError(f"prompt row {row} holds an id outside the vocabulary [0, {vocab})")
        width = self.objective.seq_len + 1
        longest = max(len(p) for p in prompts)
        if longest + self.max_new_tokens > width:
            raise ValueError(
                f"a prompt of {longest} ids plus max_new_tokens={self.max_new_tokens} needs seq_len >= "
                f"{longest + self.max_new_tokens - 1}; the objective has seq_len={self.objective.seq_len} "
                "(use seq_len = P + R - 1)"
            )
        contexts = [prompt for prompt in prompts for _ in range(self.groups)]
        generation = jax.device_get(self.policy.bind(variables)(contexts, self.max_new_tokens, key, self.sampling))
        metadata = {field: metadata_texts(batch, field, len(prompts)) for field in METADATA}
        eos_ids = set(self.sampling.eos_ids)
        sessions = []
        for index, context in enumerate(contexts):
            row, sample = divmod(index, self.groups)
            count = int(generation.lengths[index])
            ids = [int(i) for i in generation.ids[index, :count]]
            ended = bool(generation.eos[index])
            fields = {field: metadata[field][row] for field in METADATA}
            try:
                score = score_completion(self.reward, self.decode, ids, eos_ids, fields)
            except ScoringError as error:
                raise ValueError(f"{error} (on a completion of prompt row {row}, sample {sample})") from error
            call = Call(
                prompt_ids=context,
                sampled_ids=ids,
                behavior_log_probs=generation.behavior_log_probs[index, :count].tolist(),
                old_log_probs=generation.old_log_probs[index, :count].tolist(),
                finish_reason="stop" if ended else "length",
                version=version,
            )
            sessions.append(Session(
                task=Task(str(row), {"data_source": fields["data_source"]}), group=0, sample=sample, attempt=0, calls=[call],
                status=Status.COMPLETED if ended else Status.TRUNCATED, reward=float(score),
            ))
        packed = pack(sessions, width, rows=len(contexts), estimator=self.estimator, truncation="score")
        rewards = np.array([s.reward for s in sessions])
        self.metrics = {
            **reward_metrics(sessions),
            "reward/share_positive": float((rewards > 0).mean()),
            "response/eos_share": float(np.mean(generation.eos)),
        }
        return packed
