"""``Recipe`` and ``Stage``: SFT -> DPO -> GRPO (any order, any length) in one Python call.

``Recipe(model, optimizer, key, output_dir, batch, stages, pretrained=None).run()`` trains
the shared decoder through each :class:`Stage` in turn and returns every stage's final
``TrainState``, in order. That list holds every stage's parameters, optimizer state and
reference, so a long chain of a large model holds a lot of memory: keep what you need.

The type of a stage's data picks its objective; the stage name only labels its directory
(``output_dir/<name>``) and infers nothing:

- :class:`~dew.data.ChatMessages` -> SFT: ``LMObjective(loss_role=Role.ASSISTANT,
  ema_decay=None)`` over its packed rows (``seq_len`` = the loader's);
- :class:`~dew.data.PreferencePairs` -> DPO: ``DPOObjective(beta=...)`` (``seq_len`` = the
  pair width - 1);
- :class:`~dew.data.Prompts` -> GRPO: ``GRPOObjective(beta=...)`` with a
  ``SampledRollout(reward, groups, max_new_tokens)`` (``seq_len`` = max_prompt_len +
  max_new_tokens - 1), sampling at temperature 1 with the filters in ``sample``
  (``top_k``, ``top_p``, ``min_p``). The chain does not expose the rollout's ``decode``,
  ``eos_id`` or ``temperature``: its reward reads the default token-id text ("12 7 3"),
  and completions run to max_new_tokens. For rewards on decoded text or stop tokens, build
  SampledRollout and the Trainer yourself.

Each stage whose directory holds no checkpoint starts a fresh optimizer state and step
counter from the previous stage's final policy variables (the first stage from
``pretrained``, or the model's initialisation from ``key``); DPO and GRPO freeze that start
as their reference. A stage whose directory holds a checkpoint restores it and trains on
to its ``steps``, so rerunning a finished chain restores every stage and trains nothing.
Use distinct stage names and a new output directory for a fresh chain.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from dew.collection.sampled_rollout import SampledRollout
from dew.data.chat import ChatMessages, Role
from dew.data.dataset import Dataset
from dew.data.preference_pairs import PreferencePairs
from dew.data.prompts import Prompts
from dew.objectives.lm import LMObjective
from dew.objectives.dpo import DPOObjective
from dew.objectives.grpo import GRPOObjective
from dew.parallelism import Parallelism
from dew.sampling import Sampling
from dew.trainer import Trainer, TrainState
from dew.validation import distinct, integer, number, positive_int

SAMPLE_OPTIONS = ("top_k", "top_p", "min_p")
KINDS = {ChatMessages: "sft", PreferencePairs: "dpo", Prompts: "grpo"}


@dataclass(frozen=True)
class Stage:
    """One stage of a Recipe: its directory name, its data, the batches it consumes and its options.

    beta: the DPO or GRPO coefficient (None: DPOObjective's 0.1, GRPOObjective's 0); reward,
    groups, max_new_tokens, sample: GRPO's (``sample``: the rollout's top_k / top_p / min_p).
    log_every: batches between log lines (default: the stage's steps).
    """

    name: str
    data: ChatMessages | PreferencePairs | Prompts
    steps: int
    beta: float | None = None
    reward: Callable[[str, str, str, str], float] | None = None
    groups: int = 4
    max_new_tokens: int = 16
    sample: Mapping[str, float] = field(default_factory=dict)
    log_every: int | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or Path(self.name).name != self.name or self.name in (".", ".."):
            raise ValueError(f"Stage name must be a plain directory name, got {self.name!r}")
        if type(self.data) not in KINDS:
            raise TypeError(f"stage {self.name!r}: data must be ChatMessages (SFT), PreferencePairs (DPO) or Prompts "
                            f"(GRPO), got {type(self.data).__name__}")
        positive_int(f"stage {self.name!r}: steps", self.steps)
        if self.log_every is not None:
            positive_int(f"stage {self.name!r}: log_every", self.log_every)
        grpo_only = {"reward": self.reward is not None, "groups": self.groups != 4,
                     "max_new_tokens": self.max_new_tokens != 16, "sample": bool(self.sample)}
        if self.kind != "grpo" and any(grpo_only.values()):
            named = [name for name, given in grpo_only.items() if given]
            raise ValueError(f"stage {self.name!r} is {self.kind.upper()} (its data is {type(self.data).__name__}); "
                             f"{', '.join(named)} apply to GRPO stages (Prompts) only")
        if self.kind == "sft" and self.beta is not None:
            raise ValueError(f"stage {self.name!r} is SFT (ChatMessages); beta applies to DPO and GRPO stages")
        if self.beta is not None:
            number(f"stage {self.name!r}: beta", self.beta, at_least=0)
        if self.kind == "grpo":
            if not callable(self.reward):
                raise ValueError(f"stage {self.name!r} is GRPO (Prompts) and needs reward(data_source, completion, "
                                 "ground_truth, extra_info)")
            integer(f"stage {self.name!r}: groups", self.groups, at_least=2)
            positive_int(f"stage {self.name!r}: max_new_tokens", self.max_new_tokens)
            unknown = sorted(set(self.sample) - set(SAMPLE_OPTIONS))
            if unknown:
                raise ValueError(f"stage {self.name!r}: sample takes {SAMPLE_OPTIONS}, got {unknown}; the chain does not "
                                 "expose the rollout's decode, eos_id or temperature (build SampledRollout yourself)")

    @property
    def kind(self) -> str:
        return KINDS[type(self.data)]


class Recipe:
    """A chain of stages over one decoder (see the module docstring)."""

    def __init__(self, model, optimizer: optax.GradientTransformation, key: jax.Array, output_dir: str | Path,
                 batch: int, stages: Sequence[Stage], pretrained=None, progress: bool = True):
        positive_int("batch", batch)
        stages = tuple(stages)
        if not stages:
            raise ValueError("a Recipe needs at least one Stage")
        for stage in stages:
            if not isinstance(stage, Stage):
                raise TypeError(f"stages must be Stage values, got {type(stage).__name__}")
        distinct("stage names", [stage.name for stage in stages], why="they label their directories")
        self.model = model
        self.optimizer = optimizer
        self.key = key
        self.output_dir = Path(output_dir)
        self.batch = batch
        self.stages = stages
        self.pretrained = pretrained
        self.progress = progress

    def objective(self, stage: Stage, start):
        """The stage's objective and rollout (None for SFT and DPO) starting from the variables ``start``."""
        return stage_objective(self.model, stage, start)

    def initial_variables(self):
        if self.pretrained is not None:
            return self.pretrained
        seq_len = min(8, getattr(self.model, "max_seq_len", 8))
        return jax.jit(self.model.init)(jax.random.fold_in(self.key, 0), jnp.zeros((1, seq_len), jnp.int32))

    def run(self) -> list[TrainState]:
        """Train every stage in turn; each stage's final state, in order."""
        start = self.initial_variables()
        states = []
        for index, stage in enumerate(self.stages):
            trainer, data = stage_trainer(self.model, self.optimizer, jax.random.fold_in(self.key, index + 1),
                                          self.output_dir / stage.name, self.batch, stage, start, self.progress)
            state = trainer.fit(data, steps=stage.steps, log_every=stage.log_every or stage.steps)
            states.append(state)
            start = state.params
        return states


def stage_objective(model, stage: Stage, start, decode: Callable | None = None, eos_id: int | None = None):
    """A stage's objective and rollout (None for SFT and DPO) from the variables ``start``.

    The Recipe passes neither ``decode`` nor ``eos_id`` (its rewards read token-id text and
    completions run to max_new_tokens); the command line and the Ray chain, which hold the
    model directory's tokenizer, pass its ``decode`` and EOS id.
    """
    data = stage.data
    if stage.kind == "sft":
        return LMObjective(model, seq_len=data.seq_len, pretrained=start, loss_role=Role.ASSISTANT,
                           ema_decay=None), None
    beta = {} if stage.beta is None else {"beta": stage.beta}
    if stage.kind == "dpo":
        return DPOObjective(model, seq_len=data.seq_len - 1, pretrained=start, **beta), None
    objective = GRPOObjective(model, seq_len=data.max_prompt_len + stage.max_new_tokens - 1, pretrained=start, **beta)
    sampling = Sampling(temperature=1.0, eos_id=eos_id, **stage.sample)
    rollout = SampledRollout(objective, reward=stage.reward, groups=stage.groups, max_new_tokens=stage.max_new_tokens,
                             sampling=sampling, decode=decode)
    return objective, rollout


def stage_trainer(model, optimizer, key, directory: Path, batch: int, stage: Stage, start, progress: bool = True,
                  decode: Callable | None = None, eos_id: int | None = None,
                  trackers: tuple = (), parallelism: Parallelism | None = None) -> tuple[Trainer, Dataset]:
    """The Trainer (fresh optimizer and step counter, checkpoints and ``trackers``' records in ``directory``, on the
    ``parallelism`` mesh) and Dataset of one stage."""
    objective, rollout = stage_objective(model, stage, start, decode, eos_id)
    trainer = Trainer(objective, optimizer, key=key, rollout=rollout, output_dir=directory, progress=progress,
                      trackers=trackers, parallelism=parallelism)
    return trainer, stage.data.load(batch=batch)
