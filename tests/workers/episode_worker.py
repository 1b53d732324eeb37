"""One trainer process of tests/test_episode_pool.py: GRPO through an EpisodeRollout cohort.

``episode_worker.py SCENARIO PROCESS PORT OUT`` joins a two-process CPU job (gloo) unless
SCENARIO is "reference", which trains alone on the devices XLA_FLAGS gives it. The global
data is task ids [4k .. 4k + 3] at step k; each process reads its partition's rows. The
policy is test_tool_episodes.ToolPolicy sampled by TextGeneration, the environments its
square Harness. Scenarios:

- "parity" / "reference": three updates; OUT gets every episode record (actions,
  likelihoods, rewards), every projected batch and the final parameters;
- "tool_failure": on process 1, the environments of task 2 raise at their first step;
- "mismatch": process 1 builds its rollout with max_new_tokens=4.

On a failure the worker prints how many environments it opened and released (a JSON line
starting with ``RELEASED``) and ends as tests/workers/jobs.py says.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the square-tool fixtures

from jobs import run_job, task_rows  # noqa: E402 (tests/workers, the script's own folder)

HARNESS = []


def main(scenario: str, process: int, port: str, out: str) -> None:
    if scenario != "reference":
        from dew.sharding import initialize_processes

        initialize_processes(f"127.0.0.1:{port}", 2, process, local_device_count=1)

    import jax
    import numpy as np
    import optax
    from test_tool_episodes import RESULT, Harness, ToolPolicy, verify

    from dew.records.episode_protocol import EpisodeStatus, Observation
    from dew.sampling import Sampling

    from dew import Dataset, Trainer
    from dew.inference import TextGeneration
    from dew.collection.episode_rollout import EpisodeRollout
    from dew.objectives.grpo import GRPOObjective

    class Chatty(Harness):
        """Process 1's rows (task % 4 >= 2) talk for two more turns whatever the policy says: more rounds there."""

        def __call__(self, identity):
            env = super().__call__(identity)
            if identity.task % 4 >= 2:
                step, env.turns = env.step, 0

                def chat(action):
                    env.turns += 1
                    step(action)
                    if env.turns <= 2:
                        return Observation(action.context + action.tokens + (RESULT,))
                    return Observation((), EpisodeStatus.COMPLETED, "talked enough")
                env.step = chat
            return env

    class FailingHarness(Chatty):
        def __call__(self, identity):
            env = super().__call__(identity)
            if identity.task == 2:  # process 1's first row at step 0
                env.fail_on_step, env.step_error = 1, RuntimeError("the square tool crashed")
            return env

    SAMPLING = Sampling(eos_id=tuple(range(1, 12)), temperature=1.0)
    model = ToolPolicy()
    objective = GRPOObjective(model, seq_len=10)
    harness = FailingHarness() if scenario == "tool_failure" and process == 1 else Chatty()
    HARNESS.append(harness)
    records = []
    new_tokens = 4 if scenario == "mismatch" and process == 1 else 3
    episodes = EpisodeRollout(TextGeneration(model), harness, verify, max_prompt_tokens=8, max_new_tokens=new_tokens,
                              max_turns=3, groups=4, sampling=SAMPLING, record=records.append)
    # (eleven of the sixteen ids end an action, so most actions reach the environment within the budget)
    projected = []

    collected = []  # per rollout call: the records it produced

    def rollout(batch, variables, version, key, step=None):
        start = len(records)
        batch = episodes(batch, variables, version, key, step)
        projected.append(None if batch is None else {k: np.asarray(v).tolist() for k, v in batch.items()})
        collected.append(records[start:])
        return batch

    rollout.takes_step = True  # the Trainer passes the attempted step on, as to EpisodeRollout itself

    trainer = Trainer(objective, optax.adam(3e-2), key=jax.random.key(5), rollout=rollout, progress=False)
    state = trainer.fit(Dataset(train=task_rows, batch=4), steps=3)
    summary = {
        "params": [np.asarray(leaf.addressable_data(0)).tolist() for leaf in jax.tree.leaves(state.params)],
        "updates": int(state.updates),
        "records": [[{"task": r.episode.id.task, "group": r.group, "sample": r.episode.id.sample,
                      "step": r.episode.id.step, "seed": r.episode.id.seed,
                      "tokens": [list(a.action.tokens) for a in r.actions],
                      "old": [list(a.old_log_probs) for a in r.actions],
                      "behavior": [list(a.behavior_log_probs) for a in r.actions], "reward": r.reward,
                      "status": r.status.value} for r in call] for call in collected],
        "projected": projected,
        "released": all(env.closed for env in harness.opened) and len(harness.opened) > 0,
    }
    with open(out, "w") as handle:
        json.dump(summary, handle)


def released() -> None:
    opened = HARNESS[0].opened if HARNESS else []
    print("RELEASED " + json.dumps({"opened": len(opened), "closed": sum(env.closed for env in opened)}))


if __name__ == "__main__":
    run_job(main, on_failure=released)
