"""PPO targets kept as a dataset: collect once, then several PPO epochs without sampling again.

    PYTHONPATH=.:tests uv run python examples/ppo_epochs.py

One PPORollout call collects the square-tool episodes of three tasks (the fixtures of
tests/test_tool_episodes.py and tests/test_ppo.py) and prepares their targets
(old_log_probs, old_values, advantages, returns); a Trainer without a rollout then runs
four updates on that one batch, each clipped against the recorded old policy and values.
"""

import itertools

import jax
import optax
from test_ppo import TokenFeatures
from test_tool_episodes import SAMPLING, Harness, ToolPolicy, tasks, verify

from dew import Trainer
from dew.data import Dataset
from dew.collection.episode_rollout import EpisodeRollout
from dew.collection.ppo_rollout import PPORollout
from dew.objectives.ppo import PPOObjective, ValueHead

objective = PPOObjective(ToolPolicy(), seq_len=10, critic=ValueHead(TokenFeatures()), beta=0.03)
trainer = Trainer(objective, optax.adam(5e-3), key=jax.random.key(0), progress=False)
state = trainer.initial_state()
episodes = EpisodeRollout(objective.policy(), Harness(), verify, max_prompt_tokens=8, max_new_tokens=3, max_turns=3,
                          groups=8, sampling=SAMPLING)
targets = PPORollout(objective, episodes)(tasks(0, 1, 2), jax.device_get(state.params), 0, jax.random.key(1))
print(f"collected {int((targets['response_mask'] != 0).sum())} action tokens in {targets['input_ids'].shape[0]} rows")
epochs = Dataset(train=lambda partition: itertools.repeat(targets), val=None, records=None,
                 batch=targets["input_ids"].shape[0])
stream = epochs.train(None)
for epoch in range(4):
    state, metrics = trainer.step(state, next(stream))
    print(f"epoch {epoch + 1}: loss {metrics['loss']:+.4f}, value loss {metrics['value_loss']:.4f}, "
          f"clipped {metrics['policy/clipfrac']:.2f}")
assert int(state.updates) == 4
