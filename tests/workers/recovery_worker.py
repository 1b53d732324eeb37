"""The training process tests/test_episode_recovery.py kills and restarts: GRPO over journaled tool episodes.

``recovery_worker.py RUN_DIR OUT [PAUSE]`` trains a 64-id decoder (XLA_FLAGS gives it two
CPU devices, so each round is two blocks) for three updates on task ids [4k .. 4k + 3]
at step k, through EpisodeRollout with an EpisodeJournal in RUN_DIR/episodes and a
checkpoint after every update in RUN_DIR/checkpoints. The environments are real
tests/workers/square_worker.py processes (two turns: a square call, then an answer;
squares mod 64) auditing each completed square call in RUN_DIR/audit.jsonl. PAUSE
(``TASK,TURN:FILE``) makes that square call wait forever after creating FILE. OUT gets
every rollout call's records and the final parameters.
"""

import json
import sys
from pathlib import Path

import jax
import numpy as np
import optax

from dew import Dataset, Trainer, models
from dew.collection.journal import EpisodeJournal
from dew.inference import TextGeneration
from dew.collection.episode_rollout import EpisodeRollout
from dew.objectives.grpo import GRPOObjective
from dew.records.episode_protocol import EpisodeStatus
from dew.sampling import Sampling
from dew.sandbox import SandboxLimits, SubprocessEnvironment

from jobs import task_rows

WORKER = str(Path(__file__).resolve().parent / "square_worker.py")


def main(run_dir: str, out: str, pause: str | None) -> None:
    run = Path(run_dir)
    command = [sys.executable, WORKER, "--turns", "2", "--modulus", "64", "--audit", str(run / "audit.jsonl")]
    factory = SubprocessEnvironment(command + (["--pause", pause] if pause else []), SandboxLimits(wall_seconds=600))
    model = models.build("causal_transformer", vocab_size=64, emb_features=16, num_layers=1, num_heads=2,
                         mlp_features=32, max_seq_len=16)
    objective = GRPOObjective(model, seq_len=10)
    records = []

    def verifier(episode):
        return float(episode.status is EpisodeStatus.COMPLETED and episode.transitions[-1].action.tokens[0] % 3 == 0)

    episodes = EpisodeRollout(TextGeneration(model), factory, verifier, max_prompt_tokens=8, max_new_tokens=3,
                              max_turns=3, groups=2, sampling=Sampling(eos_id=tuple(range(0, 64, 2)), temperature=1.0),
                              journal=EpisodeJournal(run / "episodes"), record=records.append)
    collected = []

    def rollout(batch, variables, version, key, step=None):
        start = len(records)
        batch = episodes(batch, variables, version, key, step)
        collected.append([{"task": r.episode.id.task, "sample": r.episode.id.sample, "step": r.episode.id.step,
                           "tokens": [list(a.action.tokens) for a in r.actions],
                           "old": [list(a.old_log_probs) for a in r.actions],
                           "behavior": [list(a.behavior_log_probs) for a in r.actions],
                           "observations": [list(t.observation.context) for t in r.episode.transitions],
                           "reward": r.reward} for r in records[start:]])
        return batch

    rollout.takes_step = True  # the Trainer passes the attempted step on, as to EpisodeRollout itself

    trainer = Trainer(objective, optax.adam(3e-2), key=jax.random.key(11), rollout=rollout, progress=False,
                      output_dir=run / "checkpoints", checkpoint_every=1)
    state = trainer.fit(Dataset(train=task_rows, batch=4), steps=3)
    Path(out).write_text(json.dumps({
        "collected": collected, "updates": int(state.updates), "step": int(state.step),
        "params": [np.asarray(leaf).tolist() for leaf in jax.tree.leaves(state.params)],
    }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
