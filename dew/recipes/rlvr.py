"""Pieces of the built-in RLVR run, shared by examples/train_rlvr.py and the Ray pipeline.

The built-in run trains :func:`decoder` on the tasks of :mod:`dew.data.verifiable`:
:func:`warm_start` fits it to the tasks' demonstrations (answers only) so that GRPO
starts from a non-zero reward, :func:`measure_reward` samples held-out tasks through
any :class:`~dew.inference.RolloutServer` with fixed seeds and scores them, and
:func:`sandbox_runner` / :data:`SANDBOX_LIMITS` say where and how code completions run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import optax

from dew import Trainer, models
from dew.data.chat import Role
from dew.data.verifiable import VerifiableTask, demonstration_dataset, mean_by_family
from dew.objectives import LMObjective
from dew.sandbox import ProcessRunner, SandboxLimits, default_runner

RUNNERS = ("bwrap", "process")
# A one-line program needs a fraction of this; the limits stop a runaway loop or allocation.
SANDBOX_LIMITS = SandboxLimits(cpu_seconds=5, wall_seconds=10, memory_bytes=512 << 20, output_bytes=1 << 16)


def decoder(vocab_size: int, max_seq_len: int):
    """The tiny decoder of the built-in run: 3 layers, 96 features, 4 heads, about 0.4M parameters."""
    return models.build("causal_transformer", vocab_size=vocab_size, emb_features=96, num_layers=3, num_heads=4,
                        mlp_features=256, max_seq_len=max_seq_len)


def sandbox_runner(name: str):
    """"bwrap": bubblewrap (isolated; the default); "process": ProcessRunner, for trusted code only."""
    if name not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {name!r}")
    return default_runner() if name == "bwrap" else ProcessRunner()


def warm_start(model, tokenizer, tasks: Sequence[VerifiableTask], width: int, steps: int, batch: int,
               learning_rate: float, key, seed: int = 0, output_dir=None, progress: bool = True):
    """SFT on the tasks' demonstrations (answers only, ``steps`` updates of AdamW with a warmup-cosine schedule
    peaking at ``learning_rate`` and gradients clipped at norm 1); returns the variables in host memory.

    With ``steps=0`` the decoder's initialisation is returned untouched.
    """
    # A high peak rate reaches a useful policy in few steps; warmup and clipping keep it from diverging.
    warmup = min(20, steps // 4)
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, max(steps, warmup + 1),
                                                  learning_rate / 10)
    trainer = Trainer(LMObjective(model, seq_len=width - 1, ema_decay=None, loss_role=Role.ASSISTANT),
                      optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule)), key=key,
                      progress=progress, output_dir=output_dir)
    if steps:
        demos = demonstration_dataset(tokenizer, tasks, seq_len=width - 1, batch=batch, seed=seed)
        params = trainer.fit(demos, steps=steps, log_every=steps).params
    else:
        params = trainer.initial_state().params
    return jax.tree.map(lambda x: np.array(x, copy=True), params)  # host copy: nothing donates it later


def measure_reward(server, reward, tokenizer, tasks: Sequence[VerifiableTask], samples: int, max_new_tokens: int,
                   seed: int, workers: int = 4) -> dict[str, float]:
    """Mean reward of ``samples`` draws per task from the served policy, per family and overall (``"all"``).

    Draw ``s`` of task ``i`` uses a seed fixed by (``seed``, i, s), so two measurements
    of different weights compare the same random streams. Scoring runs on ``workers``
    threads (code tasks wait on the sandbox).
    """
    draws = [(task, server.submit(tokenizer.encode(task.prompt, add_special_tokens=False), max_new_tokens,
                                  seed=seed * 1_000_003 + index * 97 + sample))
             for index, task in enumerate(tasks) for sample in range(samples)]
    eos = tokenizer.eos_token_id

    def score(item) -> float:
        task, future = item
        ids = future.result().ids
        ids = ids[:-1] if ids and ids[-1] == eos else ids
        return reward(task.data_source, tokenizer.decode(ids), task.ground_truth, json.dumps(dict(task.extra_info)))

    with ThreadPoolExecutor(workers) as pool:
        rewards = list(pool.map(score, draws))
    return mean_by_family([task for task, _ in draws], rewards)
