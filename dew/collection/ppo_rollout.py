"""``PPORollout``: an EpisodeRollout's batch with critic values and GAE targets, for PPOObjective.

``PPORollout(objective, episodes, gamma=1., lam=.95)`` collects and packs through the
EpisodeRollout (whose policy is ``objective.policy(...)``: it samples from the policy
subtree of the Trainer's snapshot), scores every position with the critic of the same
snapshot (``old_values``), then runs GAE over the sampled actions of each whole episode in
draw order (call by call, across tool turns, chains and rows), the verifier's reward on
the last action and a zero bootstrap after it (completed episodes end there, as in the
pinned verl convention; truncated ones are masked and get no targets). The advantages are
whitened over every trainable action token of the cohort, on all processes together; a
cohort with exactly one such token is refused (its variance is undefined) and one with none
(every episode truncated, say) returns None: no update.

The batch keeps ``old_log_probs``, ``behavior_log_probs`` and ``response_mask`` and adds
``old_values``, ``advantages`` and ``returns`` (0 off the action tokens), each shaped like
``input_ids``. It can be kept and trained on for several PPO epochs without sampling again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dew.collection.episode_rollout import EpisodeRollout
from dew.losses.gae import gae, masked_whiten
from dew.sharding import exchange
from dew.validation import number


class PPORollout:
    """GAE targets over tool episodes (see the module docstring)."""

    takes_step = True  # forwarded to the EpisodeRollout

    def __init__(self, objective, episodes: EpisodeRollout, gamma: float = 1.0, lam: float = 0.95):
        if not callable(getattr(objective, "values", None)) or not callable(getattr(objective, "policy", None)):
            raise TypeError(f"PPORollout needs a PPOObjective (values and policy), got {type(objective).__name__}")
        if not isinstance(episodes, EpisodeRollout):
            raise TypeError(f"episodes must be an EpisodeRollout, got {type(episodes).__name__}")
        self.gamma = number("gamma", gamma, at_least=0, at_most=1)
        self.lam = number("lam", lam, at_least=0, at_most=1)
        self.objective, self.episodes = objective, episodes
        self._values = jax.jit(objective.values)
        self.metrics: dict[str, float] = {}

    def __call__(self, batch, variables, version: int, key: jax.Array, step: int | None = None):
        records, packed, host = self.episodes.gather(batch, variables, version, key, step)
        mask = None if packed is None else np.asarray(packed["response_mask"]) != 0
        tokens = 0 if mask is None else int(mask.sum())
        if jax.process_count() > 1:
            tokens = sum(theirs["tokens"] for theirs in exchange({"tokens": tokens}))
        if tokens == 0:
            return None  # every episode masked: zero targets, no update
        if tokens == 1:
            raise ValueError("the cohort has exactly one trainable action token; whitening its advantage is undefined "
                             "(collect more episodes or longer responses)")
        critic = host["critic"]  # the copy the episodes' policy was bound to: one gather per collection
        old_values = np.asarray(self._values(critic, {k: jnp.asarray(packed[k]) for k in
                                                      ("input_ids", "text_segment_ids", "text_positions")}))
        if not np.isfinite(old_values[mask]).all():
            raise ValueError("the critic returned a non-finite value on an action token")
        rewards = {r.group * self.episodes.groups + r.episode.id.sample: r.reward for r in records}
        advantages, returns = episode_gae(packed, old_values, rewards, self.gamma, self.lam)
        whitened = _whiten(advantages, mask)
        packed = dict(packed)
        packed["old_values"] = np.where(mask, old_values, 0.0).astype(np.float32)
        packed["advantages"] = np.where(mask, whitened, 0.0).astype(np.float32)
        packed["returns"] = np.where(mask, returns, 0.0).astype(np.float32)
        self.metrics = {**self.episodes.metrics, "values/mean": float(old_values[mask].mean()),
                        "returns/mean": float(returns[mask].mean())}
        return packed


def episode_gae(packed, values: np.ndarray, rewards: dict[int, float], gamma: float, lam: float
                ) -> tuple[np.ndarray, np.ndarray]:
    """GAE over each episode's action tokens in draw order; (advantages, returns) [rows, width] before whitening."""
    mask = np.asarray(packed["response_mask"]) != 0
    sessions = np.asarray(packed["session_index"])
    calls = np.asarray(packed["call_index"])
    rows, columns = np.nonzero(mask)
    episodes: dict[int, list[tuple[int, int, int]]] = {}
    for row, column in zip(rows.tolist(), columns.tolist()):
        episodes.setdefault(int(sessions[row, column]), []).append((int(calls[row, column]), row, column))
    advantages = np.zeros(mask.shape, np.float32)
    returns = np.zeros(mask.shape, np.float32)
    if not episodes:
        return advantages, returns
    order = {s: sorted(places) for s, places in episodes.items()}  # call, then row and column: draw order
    longest = max(len(places) for places in order.values())
    names = sorted(order)
    reward_rows = np.zeros((len(names), longest), np.float32)
    value_rows = np.zeros((len(names), longest), np.float32)
    on = np.zeros((len(names), longest), np.float32)
    for index, name in enumerate(names):
        places = order[name]
        reward = rewards.get(name)
        if reward is None or not np.isfinite(reward):
            raise ValueError(f"episode slot {name} trains without a finite reward ({reward!r})")
        value_rows[index, : len(places)] = [values[r, c] for _, r, c in places]
        reward_rows[index, len(places) - 1] = reward  # the verifier's reward on the last action
        on[index, : len(places)] = 1.0
    episode_advantages, episode_returns = (np.asarray(x) for x in gae(reward_rows, value_rows, on, gamma, lam))
    for index, name in enumerate(names):
        for step, (_, row, column) in enumerate(order[name]):
            advantages[row, column] = episode_advantages[index, step]
            returns[row, column] = episode_returns[index, step]
    return advantages, returns


def _whiten(advantages: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Whitened over every process's action tokens (two passes, as verl's masked_whiten: mean, then variance)."""
    if jax.process_count() == 1:
        return np.asarray(masked_whiten(jnp.asarray(advantages), jnp.asarray(mask)))
    picked = advantages[mask].astype(np.float64)
    everyone = exchange({"sum": float(picked.sum()), "count": int(mask.sum())})
    count = sum(theirs["count"] for theirs in everyone)
    mean = sum(theirs["sum"] for theirs in everyone) / count
    squares = sum(theirs["squares"] for theirs in exchange({"squares": float(((picked - mean) ** 2).sum())}))
    variance = squares / count * (count / (count - 1))
    return ((advantages - mean) / np.sqrt(variance + 1e-8)).astype(np.float32)
