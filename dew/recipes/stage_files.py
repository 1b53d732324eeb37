"""Stages from files: the configuration of ``dew-ray sft|dpo|grpo`` and of the Ray chain's stages.

A stage on the command line reads a Hugging Face model directory (config.json, safetensors
and tokenizer files, as ``Pretrained.save`` and ``save_pretrained`` write them) and a data
file (Parquet, JSONL, or a ``datasets`` directory saved with ``save_to_disk``):

- ``sft``: conversations, a ``messages`` column (``column=``) or verl's ``prompt``, rendered
  with the tokenizer's chat template (:class:`~dew.data.ChatMessages`, rows of seq_len + 1 ids);
- ``dpo``: pairs, token ids with masks or TRL's explicit-prompt text layout
  (``prompt``/``chosen``/``rejected``; :class:`~dew.data.PreferencePairs`, width seq_len);
- ``grpo``: prompts (text, chat messages or ids) with ``data_source``/``ground_truth``/
  ``extra_info`` (verl's layout too; :class:`~dew.data.Prompts`), scored by ``reward``:
  ``"math"`` (:class:`~dew.sandbox.MathReward` on the decoded completion) or
  ``"module:function"``, any importable function with dew's reward signature.

Unlike :class:`~dew.recipes.stage_chain.Recipe`, these runs hold the tokenizer, so a GRPO reward
reads decoded text and the tokenizer's EOS ends a completion.

:class:`StageOptions` are one stage's fields; :class:`ModelOptions` the model, tokenizer,
batch, learning rate and seed every run on a model directory has; :class:`StageRun` is both
with an output directory (a one-stage command); the Ray chain's
:class:`~dew_ray.pipelines.chain.ChainConfig` is ModelOptions with a list of :class:`StageSpec`.
:func:`run_stage` trains a StageRun in this process and writes ``<output_dir>/<kind>/``
(checkpoints and ``metrics.jsonl``; a rerun restores and trains on to ``steps``) and
``<output_dir>/policy/`` (the final policy as Hugging Face safetensors with the tokenizer).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import jax
import optax
from pydantic import Field

from dew.config import Config
from dew.parallelism import MeshOptions
from dew.data.chat import ChatMessages
from dew.data.preference_pairs import PreferencePairs
from dew.data.prompts import Prompts
from dew.models.pretrained import Pretrained
from dew.recipes.reward_routing import reward_function, verifiable_reward
from dew.recipes.rlvr_recipe import SANDBOX_LIMITS, sandbox_runner
from dew.recipes.run_inputs import DTYPES, model_tokenizer
from dew.sandbox import SandboxFleet
from dew.sharding import collective_host
from dew.recipes.stage_chain import Stage, stage_trainer
from dew.experiment_trackers import TrackerOptions
from dew.sandbox.verifiable_rewards import MathReward
from dew.trainer import TrainState

KIND = Literal["sft", "dpo", "grpo"]


class StageOptions(Config):
    """One stage's data and options (see the module docstring).

    data: the data file or directory; steps: batches to train; seq_len: SFT's predicted
    positions (rows of seq_len + 1 ids) or DPO's pair width; column: SFT's conversation column;
    max_prompt_len: GRPO's prompt width (a longer prompt keeps its end); beta: DPO's or GRPO's
    (None: the objective's default); reward: GRPO's reward, "math", "verifiable" (routed by
    ``data_source`` as the RLVR pipeline's), "module:function" or "path/file.py:function"; groups: GRPO's completions per prompt; max_new_tokens: GRPO's
    response budget; top_k, top_p: GRPO's sampling filters; enable_thinking: the chat template's
    thinking switch for GRPO's message prompts (Qwen3's; None leaves the template's default);
    log_every: updates between log lines (default: a tenth of steps).
    """

    data: str
    steps: int = Field(ge=1)
    seq_len: int = Field(default=255, ge=2)
    column: str = "messages"
    max_prompt_len: int = Field(default=64, ge=1)
    beta: float | None = Field(default=None, ge=0)
    reward: str | None = None
    groups: int = Field(default=4, ge=2)
    max_new_tokens: int = Field(default=16, ge=1)
    top_k: int | None = Field(default=None, ge=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    enable_thinking: bool | None = None
    log_every: int | None = Field(default=None, ge=1)


class StageSpec(StageOptions):
    """A stage of a chain file: its directory name and kind beside its options."""

    name: str
    kind: KIND


class ModelOptions(MeshOptions):
    """The model a run trains and how (and on which mesh: :class:`~dew.parallelism.MeshOptions`).

    model: the Hugging Face model directory; tokenizer: its tokenizer (default: the model
    directory's); dtype: what the model computes in ("bfloat16": bfloat16 products over float32
    master weights); batch: rows per batch; learning_rate: AdamW's; warmup_steps: updates over
    which the learning rate rises linearly from 0 (then constant); seed: the run's key.
    """

    model: str
    tokenizer: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    batch: int = Field(default=8, ge=1)
    learning_rate: float = Field(default=1e-5, gt=0)
    warmup_steps: int = Field(default=0, ge=0)
    seed: int = 0

    def optimizer(self) -> optax.GradientTransformation:
        """AdamW at ``learning_rate``, after a linear warm-up over ``warmup_steps`` updates."""
        rate = (optax.linear_schedule(0.0, self.learning_rate, self.warmup_steps) if self.warmup_steps
                else self.learning_rate)
        return optax.adamw(rate)

    def load_model(self, weights: bool = True):
        """(model, variables) of the model directory, computing in ``dtype`` over float32 weights (``weights=False``:
        the variables are not read, None)."""
        pretrained = Pretrained.from_directory(self.model)
        model = self.rematerialised(pretrained.model(dtype=DTYPES[self.dtype]))
        return model, pretrained.load() if weights else None


class StageRun(ModelOptions, StageOptions, TrackerOptions):
    """``dew-ray sft|dpo|grpo``: one stage on a model directory (:class:`ModelOptions`).

    output_dir: where checkpoints, metrics and the final policy go; trackers,
    wandb_project, wandb_mode: TensorBoard and W&B beside ``metrics.jsonl``
    (:class:`dew.experiment_trackers.TrackerOptions`), in ``<output_dir>/<kind>/``.
    """

    output_dir: str = "runs/stage"


def load_reward(name: str | None) -> Callable[[str, str, str, str], float]:
    """``"math"``, ``"verifiable"`` (the RLVR pipeline's routes by ``data_source``, code programs in a bubblewrap
    SandboxFleet of this process: :func:`~dew.recipes.reward_routing.verifiable_reward`), or a function of dew's
    reward signature: ``"module:function"`` or ``"path/file.py:function"``
    (:func:`~dew.recipes.reward_routing.reward_function`: a module in the working directory imports too)."""
    if name is None:
        raise ValueError("a grpo stage needs config field 'reward': \"math\", \"verifiable\", \"module:function\" "
                         "or \"file.py:function\"")
    if name == "math":
        return MathReward()
    if name == "verifiable":
        return verifiable_reward(SandboxFleet(sandbox_runner("bwrap"), SANDBOX_LIMITS))
    return reward_function(name)


def check_context(options: StageOptions, kind: str, model, model_dir) -> None:
    """Refuse a stage whose rows would not fit the model's context, naming the fields that set their width."""
    context = model.max_seq_len
    if kind == "grpo":
        width, parts = options.max_prompt_len + options.max_new_tokens, (
            f"max_prompt_len={options.max_prompt_len} + max_new_tokens={options.max_new_tokens}")
    else:
        width, parts = options.seq_len + (kind == "sft"), f"seq_len={options.seq_len}" + (" + 1" if kind == "sft" else "")
    if width > context:
        raise ValueError(f"a {kind} stage's rows of {width} ids ({parts}) exceed the model's context, "
                         f"max_position_embeddings={context} in {Path(model_dir) / 'config.json'}: lower them")


def stage_of(options: StageOptions, kind: str, name: str, tokenizer) -> Stage:
    """The Stage a config describes, its loader reading ``options.data`` with ``tokenizer``."""
    path = Path(options.data).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"config field 'data': {path} does not exist")
    common = dict(steps=options.steps, log_every=options.log_every)
    if kind == "sft":
        return Stage(name, ChatMessages(tokenizer, path, seq_len=options.seq_len, column=options.column), **common)
    beta = {"beta": options.beta} if options.beta is not None else {}
    if kind == "dpo":
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return Stage(name, PreferencePairs(path=path, seq_len=options.seq_len, tokenizer=tokenizer, pad_id=int(pad)),
                     **common, **beta)
    sample = {key: value for key, value in (("top_k", options.top_k), ("top_p", options.top_p)) if value is not None}
    thinking = {} if options.enable_thinking is None else {"enable_thinking": options.enable_thinking}
    return Stage(name, Prompts(path=path, tokenizer=tokenizer, max_prompt_len=options.max_prompt_len,
                               template_options=thinking), **common,
                 **beta, reward=load_reward(options.reward), groups=options.groups,
                 max_new_tokens=options.max_new_tokens, sample=sample)


def decoding(tokenizer) -> dict:
    """The decode and eos_id a file-based GRPO stage samples with."""
    return {"decode": lambda ids: tokenizer.decode(ids, skip_special_tokens=True), "eos_id": tokenizer.eos_token_id}


def export_policy(model_dir: str | Path, params, directory: str | Path, tokenizer) -> Path:
    """The policy ``params`` as Hugging Face safetensors (model_dir's architecture) with the tokenizer."""
    directory = Path(directory)
    Pretrained.from_directory(model_dir).save(params, directory)
    tokenizer.save_pretrained(directory)
    return directory


def run_stage(config: StageRun, kind: str, progress: bool = True) -> tuple[TrainState, Path]:
    """Train one stage in this process (see the module docstring); returns its final state and policy directory."""
    tokenizer = model_tokenizer(config.model, config.tokenizer)
    model, start = config.load_model()
    check_context(config, kind, model, config.model)
    stage = stage_of(config, kind, kind, tokenizer)
    output = Path(config.output_dir).expanduser()
    output.mkdir(parents=True, exist_ok=True)
    (output / "config.json").write_text(json.dumps({"kind": kind, **config.model_dump()}, indent=2))
    trainer, data = stage_trainer(model, config.optimizer(), jax.random.key(config.seed),
                                  output / kind, config.batch, stage, start, progress,
                                  **(decoding(tokenizer) if kind == "grpo" else {}), parallelism=config.parallelism(),
                                  trackers=config.experiment_trackers(name=f"{output.name}-{kind}"))
    state = trainer.fit(data, steps=config.steps, log_every=config.log_every or max(1, config.steps // 10))
    return state, export_policy(config.model, collective_host(state.params),
                                output / "policy", tokenizer)
