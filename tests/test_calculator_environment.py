"""The built-in calculator environment: what it evaluates and refuses, its episodes, its verifier, its warm-start
demonstrations, and the environment factories a run's config names."""

import pytest

from dew.data.chat import Role
from dew.data.verifiable import MATH_SOURCE, task_tokenizer, verifiable_tasks
from dew.recipes.calculator_environment import (
    CalculatorEnvironment,
    CalculatorError,
    calculator,
    calculator_demonstrations,
    evaluate,
    show,
    tool_call,
)
from dew.recipes.run_environment import EnvironmentSetup, build_environment, environment_factory
from dew.records.episode_protocol import Action, Episode, EpisodeId, EpisodeStatus, Transition
from dew.records.session_records import Task
from dew.sandbox.verifiable_rewards import MathReward

TOKENIZER = task_tokenizer()
EOS = TOKENIZER.eos_token_id


def encode(text):
    return TOKENIZER.encode(text, add_special_tokens=False)


def test_the_calculator_evaluates_arithmetic_and_refuses_everything_else():
    assert tool_call("I will use calc(40+7) now") == "40+7"
    assert tool_call("calc((2+3)*(4-1)) and calc(9)") == "(2+3)*(4-1)"  # the first call, parentheses balanced
    assert tool_call("calc(1+") == "1+" and tool_call(" \\boxed{47}") is None
    assert [evaluate(e) for e in ("40+7", "(2+3)*(4-1)", "7/2", "7//2", "-3**2", "2**10", "10%4")] == \
        [47, 15, 3.5, 3, -9, 1024, 2]
    assert [show(v) for v in (47, 3.5, 6.0, 1 / 3)] == ["47", "3.5", "6", "0.333333"]
    refused = {"__import__('os')": "only numbers", "a+1": "only numbers", "1/0": "division by zero",
               "2**100": "exponent past 12", "1+": "not an expression", "1" * 65: "longer than 64", "'7'": "only numbers"}
    for expression, why in refused.items():
        with pytest.raises(CalculatorError, match=why):
            evaluate(expression)


def episode_of(env, responses):
    """Run ``responses`` (texts, each ended on EOS) through ``env``; the episode and its observations."""
    episode = Episode(EpisodeId(0, 0, 0, 0), env.reset())
    for text in responses:
        action = Action(episode.last.context, tuple(encode(text) + [EOS]), True, policy_step=-1)
        episode.transitions.append(Transition(action, env.step(action)))
        if episode.last.terminal:
            break
    return episode


def test_an_episode_calls_the_tool_reads_the_result_and_answers():
    prompt = encode("What is forty plus seven?")
    decode = lambda ids: TOKENIZER.decode(ids, skip_special_tokens=True)  # noqa: E731
    env = CalculatorEnvironment(prompt, encode, decode, (EOS,), max_turns=3)
    episode = episode_of(env, ["calc(40+7)", "calc(4/0)", " \\boxed{47}"])
    first, second, last = episode.transitions
    # the result follows the call's own ids, EOS included: the next context extends the last one exactly
    assert first.observation.context == (*prompt, *encode("calc(40+7)"), EOS, *encode("=47\n"))
    assert second.observation.context[len(first.observation.context):] == (*encode("calc(4/0)"), EOS,
                                                                           *encode("error: division by zero\n"))
    assert "refused: division by zero" in second.observation.detail
    assert last.observation.status is EpisodeStatus.COMPLETED
    assert env.metrics() == {"tool_calls": 2.0, "tool_errors": 1.0}
    # a call on the last turn ends the episode truncated; the verifier still scores that response
    env = CalculatorEnvironment(prompt, encode, decode, (EOS,), max_turns=2)
    episode = episode_of(env, ["calc(1+1)", "calc(40+7)"])
    assert episode.status is EpisodeStatus.TRUNCATED and "max_turns=2" in episode.detail


def test_the_verifier_scores_the_last_response_with_the_runs_reward():
    setup = EnvironmentSetup(TOKENIZER, MathReward(), (EOS,), 2)
    with pytest.raises(TypeError, match="must return \\(environment, verifier\\)"):
        build_environment(lambda s: "not a pair", setup)
    environment, verifier = build_environment(calculator, setup)
    prompt = encode("What is forty plus seven?")
    task = Task("t", {"prompt_ids": prompt, "data_source": MATH_SOURCE, "ground_truth": "47", "extra_info": "{}"})
    right = episode_of(environment(task, EpisodeId(0, 0, 0, 0)), ["calc(40+7)", " \\boxed{47}"])
    wrong = episode_of(environment(task, EpisodeId(0, 0, 1, 0)), ["calc(40+7)", " \\boxed{48}"])
    assert (verifier(task, right), verifier(task, wrong)) == (1.0, 0.0)


def test_the_built_in_demonstrations_show_the_call_and_train_only_the_policys_turns():
    tasks = verifiable_tasks(6, seed=3)
    documents, roles = calculator_demonstrations(TOKENIZER, tasks)
    for task, ids, role in zip(tasks, documents, roles):
        assert len(ids) == len(role)
        trained = TOKENIZER.decode([i for i, r in zip(ids, role) if r == Role.ASSISTANT])
        if task.family == "math":
            a, b = task.extra_info["a"], task.extra_info["b"]
            assert TOKENIZER.decode(ids) == (f"{task.prompt}calc({a}+{b})<|endoftext|>={a + b}\n"
                                             f"{task.answer}<|endoftext|>")
            assert trained == f"calc({a}+{b})<|endoftext|>{task.answer}<|endoftext|>"  # not the tool's result
            assert TOKENIZER.decode([i for i, r in zip(ids, role) if r == Role.TOOL]) == f"={a + b}\n"
        else:  # code tasks answer directly, as without the environment
            assert trained == f"{task.answer}<|endoftext|>" and Role.TOOL not in role


def test_a_config_names_a_built_in_environment_or_a_factory_of_its_own(tmp_path, monkeypatch):
    assert environment_factory("calculator") is calculator
    (tmp_path / "my_env.py").write_text("from dew.recipes.calculator_environment import calculator as make\n")
    monkeypatch.chdir(tmp_path)
    assert environment_factory("my_env.py:make").load() is calculator
    assert environment_factory("my_env:make").load() is calculator
    with pytest.raises(ValueError, match="'environment' must be one of \\['calculator'\\], \"module:factory\""):
        environment_factory("abacus")
    with pytest.raises(ValueError, match="config field 'environment' \\('nowhere:make'\\): no module 'nowhere'.*"
                                         "\"environments.py:make\""):
        environment_factory("nowhere:make")
    with pytest.raises(ValueError, match="config field 'environment' \\('my_env.py:build'\\): .*no function 'build'"):
        environment_factory("my_env.py:build")
