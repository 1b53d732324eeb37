"""What an RLVR run will train, worked out before any work starts: :func:`plan_run`.

The built-in run and a user's run take one path. :func:`plan_run` reads the config's
``model`` (or builds the built-in decoder for the built-in tasks' character tokenizer),
its prompt rows (the config's ``prompts`` file, or the built-in tasks as verl rows) and
held-out rows (``val_prompts``, else the first ``eval_tasks`` prompt rows, else the built-in
held-out split), renders and measures every prompt as the trainers will
(:func:`~dew.recipes.run_inputs.fit_prompts`, ``max_prompt_length`` leaving longer ones out),
sizes the row width, and checks what would fail later: the width past the model's context,
a data source no reward route scores, a reward function or environment factory that does
not import, a context limit shorter than the prompts. With an ``environment`` the row
holds the longest context a model call reads and one response. Every
check names the fields involved and the values they add up to.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from dew.data.verifiable import demonstration_documents, task_rows, task_tokenizer
from dew.recipes.calculator_environment import calculator_demonstrations
from dew.recipes.function_reference import FunctionReference, function_reference
from dew.recipes.judge_reward import first_number
from dew.recipes.reward_routing import VERIFIABLE_SOURCES, check_sources, reward_function
from dew.recipes.rlvr_recipe import built_in_tasks, decoder, packed_shape
from dew.recipes.run_environment import environment_factory
from dew.recipes.run_inputs import DTYPES, FittedPrompts, Policy, fit_prompts, load_policy, read_prompt_rows
from dew.models.pretrained import Pretrained


class PlanError(ValueError):
    """A run that cannot start as configured (the message names the fields and what to change)."""


@dataclasses.dataclass
class RunPlan:
    """The policy, the prompts to train on and to measure on, the row width and the reward of one run."""

    policy: Policy
    train: FittedPrompts
    held_out: FittedPrompts
    held_out_source: str  # where the held-out rows come from, for the run's first lines
    prompt_len: int
    width: int
    reward: str | FunctionReference  # "verifiable", or the user's function by reference
    eos_ids: tuple[int, ...]
    template_options: dict
    built_in: list | None = None  # the built-in run's training tasks (its warm start's demonstrations)
    environment: object = None  # the environment factory (config environment), or None for single-turn draws
    context_tokens: int | None = None  # with an environment, the longest context a model call reads
    demonstrations: Callable = demonstration_documents  # how the built-in warm start writes a task's demonstration
    judge: Policy | None = None  # reward="judge": the judge model, its weights and tokenizer
    judge_eos_ids: tuple[int, ...] = ()
    judge_parse: Callable | None = None  # from the judge's reply to a number

    def describe(self) -> list[str]:
        """The lines a run prints first: the model, the prompts and what was left out."""
        lines = [f"policy: {self.policy.source}; rows of {self.width} ids ({self.prompt_len} prompt + "
                 f"{self.width - self.prompt_len} response)",
                 f"prompts: {len(self.train.rows)} to train on, {len(self.held_out.rows)} to measure on "
                 f"({self.held_out_source})"]
        if self.judge is not None:
            lines.append(f"reward: the judge {self.judge.source}")
        if self.environment is not None:
            lines.append(f"environment: {self.environment_name}, model calls read at most {self.context_tokens} ids "
                         f"(max_context_tokens) and draw {self.width - self.context_tokens} each")
        for name, fitted in (("training", self.train), ("measured", self.held_out)):
            if fitted.filtered:
                lines.append(f"max_prompt_length: {fitted.filtered} {name} prompts longer than it were left out")
        return lines

    @property
    def environment_name(self) -> str:
        return getattr(self.environment, "spec", getattr(self.environment, "__name__", repr(self.environment)))


def _eos_ids(policy: Policy, directory: Path | None) -> tuple[int, ...]:
    """The tokenizer's EOS and, for a model directory, its generation_config.json's (chat models end turns there)."""
    ids = [int(policy.tokenizer.eos_token_id)]
    config = directory / "generation_config.json" if directory is not None else None
    if config is not None and config.exists():
        found = json.loads(config.read_text()).get("eos_token_id")
        ids += [int(i) for i in (found if isinstance(found, list) else [found] if found is not None else [])]
    return tuple(dict.fromkeys(ids))


def plan_run(config) -> RunPlan:
    """Work out the run of ``config`` (an RLVRPipelineConfig); raises PlanError naming what to change."""
    try:
        return _plan(config)
    except PlanError:
        raise
    except ValueError as error:
        raise PlanError(str(error)) from None


def _plan(config) -> RunPlan:
    # The files and the reward first (a bad row fails in milliseconds), then the model and its tokenizer (seconds).
    tasks, held_tasks = built_in_tasks(config) if config.model is None or not config.prompts else (None, None)
    rows = read_prompt_rows(config.prompts) if config.prompts else task_rows(tasks)
    if config.val_prompts:
        held_rows, held_source = read_prompt_rows(config.val_prompts, "val_prompts"), f"val_prompts {config.val_prompts}"
    elif config.prompts:
        held_rows = rows[:config.eval_tasks]
        held_source = f"the first {len(held_rows)} rows of prompts, which training sees too: set val_prompts"
    else:
        held_rows = task_rows(held_tasks)
        held_source = "the built-in held-out split"
    reward = config.reward if config.reward in ("verifiable", "judge") else reward_function(config.reward)
    parse = None
    if reward == "judge":
        parse = first_number if config.judge_parser == "first_number" else function_reference(config.judge_parser,
                                                                                              "judge_parser")
    environment = environment_factory(config.environment) if config.environment else None
    if reward == "verifiable":
        check_sources({str(row["data_source"]) for row in [*rows, *held_rows]}, VERIFIABLE_SOURCES, "the prompts")
    if config.model is not None:
        policy = load_policy(config.model, config.tokenizer, config.dtype)
        tasks = None  # a user's model has no built-in warm start
    else:
        if "word" in config.families:
            raise PlanError("config field 'families' includes \"word\", which needs 'model': the word problems are "
                            "chat messages for a real chat model, and the built-in decoder reads characters")
        policy = Policy(None, None, task_tokenizer(), None, "the built-in decoder, warm-started on "
                        + (f"{config.warm_start}" if config.warm_start else "the built-in demonstrations"))
    tokenizer = policy.tokenizer
    options = {} if config.enable_thinking is None else {"enable_thinking": config.enable_thinking}
    train = fit_prompts(rows, tokenizer, config.max_prompt_length, "prompts", config.enable_thinking)
    held_out = fit_prompts(held_rows, tokenizer, config.max_prompt_length,
                           "val_prompts" if config.val_prompts else "prompts", config.enable_thinking)
    prompt_len = max(train.longest, held_out.longest)
    demonstrations = policy.model is None and config.warm_start is None  # the built-in warm start's
    if demonstrations:  # its rows must fit too, whatever prompts GRPO trains on
        prompt_len = max(prompt_len, *(len(tokenizer.encode(t.prompt, add_special_tokens=False)) for t in tasks))
    context = None
    if environment is not None:  # a model call reads the prompt, earlier responses and tool results
        context = config.max_context_tokens or prompt_len + (config.max_turns - 1) * 2 * config.max_new_tokens
        if context < prompt_len:
            raise PlanError(f"config field 'max_context_tokens' ({context}) is shorter than the longest prompt "
                            f"({prompt_len} ids): no episode could make a model call")
    width = (context or prompt_len) + config.max_new_tokens
    if policy.model is None:  # the built-in decoder is sized to the run
        if config.dtype != "float32":
            raise PlanError(f"config field 'dtype' ({config.dtype!r}) needs 'model': the built-in decoder trains "
                            "in float32")
        if demonstrations:
            answer = max(len(tokenizer.encode(t.answer, add_special_tokens=False)) + 1 for t in tasks)
            if config.max_new_tokens < answer:
                raise PlanError(f"config field 'max_new_tokens' ({config.max_new_tokens}) is shorter than the longest "
                                f"reference answer of the tasks ({answer} ids with EOS): the warm start could not "
                                "show it and no completion could reach it")
        # sized to hold a packed row of shared prompts too (RLVRConfig.share_prompts): positions stay below width
        model = decoder(len(tokenizer), max_seq_len=packed_shape(config, width, prompt_len, True)[0], engine=config.engine)
        policy = dataclasses.replace(policy, model=model, pretrained=Pretrained.from_model(model))
    elif width > policy.model.max_seq_len:
        longest = (f"max_prompt_length={config.max_prompt_length}" if config.max_prompt_length
                   else "the longest prompt")
        if context is not None:
            raise PlanError(f"rows of {width} ids (max_context_tokens: {context} ids, + max_new_tokens="
                            f"{config.max_new_tokens}) exceed the model's context, max_position_embeddings="
                            f"{policy.model.max_seq_len}: lower max_context_tokens, max_turns or max_new_tokens")
        raise PlanError(f"rows of {width} ids ({longest}: {prompt_len} ids, + max_new_tokens="
                        f"{config.max_new_tokens}) exceed the model's context, max_position_embeddings="
                        f"{policy.model.max_seq_len}: lower max_new_tokens or set max_prompt_length")
    judge, judge_eos = None, ()
    if reward == "judge":  # its own tokenizer and EOS; greedy, so its verdicts repeat
        judge = load_policy(config.judge_model, field="judge_model")
        judge_eos = _eos_ids(judge, Path(config.judge_model).expanduser())
        if config.judge_max_length > judge.model.max_seq_len:
            raise PlanError(f"config field 'judge_max_length' ({config.judge_max_length}) exceeds the judge's "
                            f"context, max_position_embeddings={judge.model.max_seq_len}")
    directory = Path(config.model).expanduser() if config.model else None
    return RunPlan(policy, train, held_out, held_source, prompt_len, width, reward, _eos_ids(policy, directory),
                   options, built_in=tasks, environment=environment, context_tokens=context,
                   demonstrations=calculator_demonstrations if config.environment == "calculator"
                   else demonstration_documents, judge=judge, judge_eos_ids=judge_eos, judge_parse=parse)


__all__ = ["DTYPES", "PlanError", "RunPlan", "plan_run"]
