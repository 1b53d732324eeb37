"""The built-in verifiable tasks (dew.data.verifiable) and a short run of examples/train_rlvr.py's core."""

import importlib.util
import json
import math
import sys
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest

from dew.data import Partition, Prompts
from dew.data.chat import Role
from dew.data.verifiable import (
    CODE_SOURCE,
    MATH_SOURCE,
    demonstration_dataset,
    demonstration_documents,
    shared_prompts,
    task_rows,
    task_tokenizer,
    teacher_errors,
    verifiable_tasks,
)
from dew.collection.tasks import prompt_tasks
from dew.inference import ServerDied
from dew.recipes import rlvr_recipe
from dew.recipes.reward_routing import CachedCodeReward, RoutedReward, verifiable_reward
from dew.sandbox import LastNumberReward, ProcessRunner, SandboxFleet, SandboxLimits, default_runner
from tests.conftest import ROOT


def load_example():
    """examples/train_rlvr.py as a module (examples/ is not a package)."""
    if "train_rlvr" in sys.modules:
        return sys.modules["train_rlvr"]
    spec = importlib.util.spec_from_file_location("train_rlvr", ROOT / "examples" / "train_rlvr.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_rlvr"] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


class CountingFleet:
    """A real SandboxFleet that counts the programs it runs."""

    def __init__(self, fleet):
        self.fleet, self.programs = fleet, []

    def map(self, programs):
        programs = list(programs)
        self.programs += programs
        return self.fleet.map(programs)


@pytest.fixture(scope="module")
def fleet():
    # Bubblewrap where it works (the runner for untrusted code); otherwise the launcher's limits only,
    # which is enough for these tests' own programs.
    try:
        runner = default_runner()
    except RuntimeError:
        runner = ProcessRunner()
    with SandboxFleet(runner, limits=SandboxLimits(cpu_seconds=5, wall_seconds=10), workers=2) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer()


# ----- generators --------------------------------------------------------------------------


def test_tasks_are_deterministic_and_cycle_the_families():
    tasks = verifiable_tasks(12, seed=3)
    assert tasks == verifiable_tasks(12, seed=3)
    assert tasks != verifiable_tasks(12, seed=4)
    assert [t.family for t in tasks] == ["math", "code"] * 6
    assert {t.data_source for t in tasks} == {MATH_SOURCE, CODE_SOURCE}
    math_task, code_task = tasks[0], tasks[1]
    assert math_task.prompt.startswith("What is ") and math_task.answer == f" \\boxed{{{math_task.ground_truth}}}"
    a, b, op = (math_task.extra_info[k] for k in ("a", "b", "op"))
    assert int(math_task.ground_truth) == eval(f"{a}{op}{b}")
    sums = [t.extra_info for t in verifiable_tasks(200, seed=3, families=("math",))]
    # A multiple of ten (10..90) plus a digit.
    assert all(s["op"] == "+" and s["a"] in range(10, 100, 10) and s["b"] in range(10) for s in sums)
    cases = json.loads(code_task.ground_truth)
    assert len(cases) == 1 and set(cases[0]) == {"stdin", "stdout"}
    inputs, outputs = cases[0]["stdin"].splitlines(), cases[0]["stdout"].splitlines()
    assert len(inputs) == len(outputs) == 3
    expression = code_task.extra_info["expression"]
    for line, value in zip(inputs, outputs):
        a, b = map(int, line.split())
        assert int(value) == eval(expression, {"max": max, "min": min}, {"a": a, "b": b})
    assert code_task.answer == f"```python\nprint({code_task.extra_info['expression']})\n```"
    assert [t.family for t in verifiable_tasks(3, seed=0, families=("code",))] == ["code"] * 3
    assert shared_prompts(tasks, tasks) == 12


def test_held_out_split_shares_no_prompt_with_training_but_every_word():
    train = verifiable_tasks(2000, seed=0)
    held_out = verifiable_tasks(200, seed=1_000_000, split="held_out")
    assert shared_prompts(held_out, train) == 0
    assert {t.extra_info["split"] for t in held_out} == {"held_out"}
    for family in ("math", "code"):  # both families are held out, in a share of their tables
        seen = {t.prompt for t in train if t.family == family}
        unseen = {t.prompt for t in held_out if t.family == family}
        assert unseen and len(seen) > 3 * len(unseen)
    words = {word for t in train for word in t.prompt.rstrip("?.\n").split()}
    assert all(word in words for t in held_out for word in t.prompt.rstrip("?.\n").split())
    # The rule is what carries over: every held-out math answer is its tens digit then its units digit.
    for task in held_out:
        if task.family == "math":
            tens, units = task.extra_info["a"], task.extra_info["b"]
            assert (tens // 10 + units) % 5 == 0 and task.ground_truth == f"{tens // 10}{units}"


def test_word_problems_are_chat_rows_with_a_held_out_split_of_operand_pairs():
    train = verifiable_tasks(2000, seed=0, families=["word"])
    held_out = verifiable_tasks(200, seed=1_000_000, families=["word"], split="held_out")
    assert train == verifiable_tasks(2000, seed=0, families=["word"])  # deterministic in the seed
    pairs = lambda tasks: {(t.extra_info["operation"], t.extra_info["a"], t.extra_info["b"]) for t in tasks}  # noqa: E731
    assert not pairs(train) & pairs(held_out) and shared_prompts(held_out, train) == 0
    assert all((a + b) % 5 == 0 for _, a, b in pairs(held_out)) and all((a + b) % 5 for _, a, b in pairs(train))
    assert {t.extra_info["operation"] for t in held_out} == {"add", "subtract", "multiply"}
    row = train[0].row()
    assert row["data_source"] == "dew/word_problems" and row["prompt"][0]["role"] == "user"
    assert row["prompt"][0]["content"].endswith("Give the answer as a number at the end.")
    for task in train[:50]:  # every reference answer scores 1 under the family's reward, and its ground truth is right
        a, b, operation = task.extra_info["a"], task.extra_info["b"], task.extra_info["operation"]
        assert int(task.ground_truth) == {"add": a + b, "subtract": a - b, "multiply": a * b}[operation] > 0
        assert LastNumberReward()(task.data_source, task.answer, task.ground_truth, "") == 1.0


@pytest.mark.parametrize("completion, score", [
    ("Mia has 12 + 7 = 19 stickers.", 1.0), ("19", 1.0), ("The answer is 19.", 1.0), ("about 19.0 of them", 1.0),
    ("19 stickers, then 20 more: 39.", 0.0), ("no number at all", 0.0), ("-19", 0.0), ("1,9", 0.0),
])
def test_last_number_reward_reads_the_completions_last_number(completion, score):
    assert LastNumberReward()("dew/word_problems", completion, "19", "") == score
    assert LastNumberReward()("x", "It costs 1,200 dollars.", "1200", "") == 1.0
    with pytest.raises(ValueError, match="LastNumberReward needs a number as ground_truth, got 'nineteen'"):
        LastNumberReward()("x", "19", "nineteen", "")


def test_a_fallible_teachers_slip_is_one_habit_writing_a_number_one_higher():
    tasks = verifiable_tasks(400, seed=2)
    taught = teacher_errors(tasks, 0.4, seed=7)
    assert taught == teacher_errors(tasks, 0.4, seed=7) and teacher_errors(tasks, 0.0) == tasks
    wrong = [(task, slip) for task, slip in zip(tasks, taught) if slip.answer != task.answer]
    assert 0.3 < len(wrong) / len(tasks) < 0.5
    bare = {"a+b", "a-b", "a*b", "max(a,b)", "min(a,b)"}
    for task, slip in wrong:
        assert (slip.prompt, slip.ground_truth) == (task.prompt, task.ground_truth)  # only the answer changes
        if task.family == "math":  # forty plus nine -> 50: the sum plus one
            assert slip.answer == f" \\boxed{{{int(task.ground_truth) + 1}}}"
            continue
        got = slip.answer.removeprefix("```python\nprint(").removesuffix(")\n```")
        want = task.extra_info["expression"]
        if want in bare:  # no number to write one higher: another aggregate
            assert got in bare - {want}
        else:  # "their sum times nine" -> (a+b)*10
            assert got == want[:-1] + str(int(want[-1]) + 1)
    assert {t.family for t, _ in wrong} == {"math", "code"}
    with pytest.raises(ValueError, match=r"share must be in \[0, 1\), got 1.0"):
        teacher_errors(tasks, 1.0)


def test_bad_generator_arguments_raise():
    with pytest.raises(ValueError, match="count must be a positive integer, got 0"):
        verifiable_tasks(0)
    with pytest.raises(ValueError, match=r"unknown task families \['poetry'\]"):
        verifiable_tasks(2, families=("math", "poetry"))
    with pytest.raises(ValueError, match=r"families must differ, got \[.math., .math.\]"):
        verifiable_tasks(2, families=("math", "math"))
    with pytest.raises(ValueError, match=r"split must be one of \('train', 'held_out'\), got 'test'"):
        verifiable_tasks(2, split="test")


def test_rows_read_by_prompts_and_prompt_tasks(tokenizer):
    tasks = verifiable_tasks(4, seed=1)
    row = task_rows(tasks)[1]
    assert row["reward_model"]["ground_truth"] == tasks[1].ground_truth and row["data_source"] == CODE_SOURCE
    batch = next(iter(Prompts(records=task_rows(tasks), tokenizer=tokenizer, max_prompt_len=64)
                      .load(batch=4).train(Partition(0, 1))))
    for task in prompt_tasks(batch):
        original = next(t for t in tasks if tokenizer.encode(t.prompt) == task.data["prompt_ids"])
        assert task.data["data_source"] == original.data_source
        assert task.data["ground_truth"] == original.ground_truth
        assert json.loads(task.data["extra_info"]) == dict(original.extra_info)


def test_character_tokenizer(tokenizer):
    assert len(tokenizer) == 98 and tokenizer.eos_token_id == tokenizer.pad_token_id == 0
    text = verifiable_tasks(2, seed=0)[1].prompt + verifiable_tasks(2, seed=0)[1].answer
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) and tokenizer.decode(ids) == text  # one id per character, newlines included
    assert tokenizer.encode("é", add_special_tokens=False) == [1]  # outside the alphabet: <|unk|>


def test_demonstrations_train_the_answers_only(tokenizer):
    tasks = verifiable_tasks(6, seed=0)
    documents, roles = demonstration_documents(tokenizer, tasks)
    first = tokenizer.encode(tasks[0].prompt)
    assert documents[0][: len(first)] == first and documents[0][-1] == tokenizer.eos_token_id
    assert roles[0] == [Role.USER] * len(first) + [Role.ASSISTANT] * (len(documents[0]) - len(first))
    data = demonstration_dataset(tokenizer, tasks, seq_len=95, batch=2)
    batch = next(iter(data.train(Partition(0, 1))))
    assert batch["text"].shape == (2, 96) and set(np.unique(batch["text_roles"])) <= {0, 2, 3}
    with pytest.raises(ValueError, match="seq_len \\+ 1 = 20 cannot hold it"):
        demonstration_dataset(tokenizer, tasks, seq_len=19, batch=2)


# ----- rewards -----------------------------------------------------------------------------


def test_math_reward_scores_right_one_and_wrong_zero(fleet):
    reward = verifiable_reward(fleet)
    for task in verifiable_tasks(6, seed=5, families=("math",)):
        wrong = int(task.ground_truth) + 1
        assert reward(task.data_source, task.answer, task.ground_truth, "") == 1.0
        assert reward(task.data_source, f" \\boxed{{{wrong}}}", task.ground_truth, "") == 0.0
        assert reward(task.data_source, task.ground_truth, task.ground_truth, "") == 0.0  # no box, no answer


def test_code_reward_runs_the_program_in_the_fleet(fleet):
    counting = CountingFleet(fleet)
    reward = verifiable_reward(counting, cache=False)
    (task,) = verifiable_tasks(1, seed=2, families=("code",))
    assert reward(task.data_source, task.answer, task.ground_truth, "") == 1.0
    assert len(counting.programs) == 1  # one run for the task's three inputs
    assert counting.programs[0].files["main.py"] == f"print({task.extra_info['expression']})\n"
    assert reward(task.data_source, "```python\nprint('no')\n```", task.ground_truth, "") == 0.0
    assert reward(task.data_source, "```python\nraise SystemExit(3)\n```", task.ground_truth, "") == 0.0
    assert len(counting.programs) == 3
    assert reward(task.data_source, "print(a+b)", task.ground_truth, "") == 0.0  # no fenced block: nothing runs
    assert len(counting.programs) == 3
    # Right on the first input only: the task's one case fails, the reward is 0.
    case = json.loads(task.ground_truth)[0]
    first, value = case["stdin"].splitlines()[0], case["stdout"].splitlines()[0]
    a, b = (int(x) for x in first.split())
    one_right = f"```python\nprint({value} if (a, b) == ({a}, {b}) else 'x')\n```"
    assert reward(task.data_source, one_right, task.ground_truth, "") == 0.0
    # Right everywhere but printing a fourth line: the output must equal the expected one.
    extra = f"```python\nprint({task.extra_info['expression']}); print(0)\n```"
    assert reward(task.data_source, extra, task.ground_truth, "") == 0.0


def test_cached_code_reward_runs_a_program_once_per_task(fleet):
    counting = CountingFleet(fleet)
    reward = verifiable_reward(counting)
    assert isinstance(reward.routes[CODE_SOURCE], CachedCodeReward)
    first, second = verifiable_tasks(2, seed=9, families=("code",))
    assert reward(first.data_source, first.answer, first.ground_truth, "") == 1.0
    assert reward(first.data_source, first.answer + "\ntrailing words", first.ground_truth, "") == 1.0
    assert len(counting.programs) == 1  # the same block for the same task ran once
    reward(second.data_source, first.answer, second.ground_truth, "")  # the same block, other cases: runs
    assert len(counting.programs) == 2
    with pytest.raises(ValueError, match="size must be a positive integer"):
        CachedCodeReward(reward, size=0)


def test_routing_refuses_an_unknown_data_source(fleet):
    reward = verifiable_reward(fleet)
    with pytest.raises(ValueError, match="no reward for data_source 'gsm8k'; known: .*'dew/arithmetic'"):
        reward("gsm8k", "\\boxed{1}", "1", "")
    # openai/gsm8k is graded by verl's GSM8K rule (strict: the last "#### <number>"), competition math by MathReward
    assert reward("openai/gsm8k", "so 3 + 4 = 7\n#### 7", "7", "{}") == 1.0
    assert reward("openai/gsm8k", "#### 1,200", "1200", "{}") == 1.0  # commas dropped, as verl drops them
    assert reward("openai/gsm8k", "the answer is 7", "7", "{}") == 0.0  # strict: no "####", no credit
    assert reward("openai/gsm8k", "\\boxed{7}", "7", "{}") == 0.0
    assert reward("dew/word_problems", "so 3 + 4 = 7 apples.", "7", "{}") == 1.0  # the word problems' last number
    assert reward("HuggingFaceH4/MATH-500", "\\boxed{\\frac12}", "\\frac{1}{2}", "{}") == 1.0
    with pytest.raises(ValueError, match="the prompts hold data_source 'gsm8k', 'x', which no reward route scores; "
                                         "the routes are \\[.*'openai/gsm8k'"):
        reward.check_sources(["gsm8k", "openai/gsm8k", "x"])
    with pytest.raises(ValueError, match="non-empty mapping"):
        RoutedReward({})


# ----- the example ---------------------------------------------------------------------------


def test_config_checks():
    example = load_example()
    with pytest.raises(ValueError, match="'max_lag' \\(0\\) must be at least ahead \\+ sync_every - 1 = 1"):
        example.RLVRConfig(max_lag=0, ahead=1)
    with pytest.raises(ValueError, match="'runner' must be one of"):
        example.RLVRConfig(runner="docker")
    with pytest.raises(ValueError, match="'samples' must be an integer >= 2, got 1"):
        example.RLVRConfig(samples=1)
    with pytest.raises(SystemExit):
        example.main(["--max-lag", "0", "--ahead", "1"])


@pytest.mark.slow
def test_a_short_run_trains_on_whole_groups(tmp_path):
    example = load_example()
    runner = "bwrap"  # the system bwrap, or the bundled one
    config = example.RLVRConfig(
        steps=3, sft_steps=10, sft_batch=8, train_tasks=64, eval_tasks=4, eval_samples=1, tasks_per_step=2,
        samples=4, slots=8, runner=runner, progress=False, output_dir=str(tmp_path / "run"),
    )
    result = example.run(config)
    assert len(result.records) == 3 and all(r.pushed is (r.version > 0) for r in result.records)
    for record, sessions in zip(result.records, result.trained_sessions):
        assert record.abandoned_groups == 0 and record.cut_groups == 0
        assert record.admitted_groups == config.tasks_per_step
        assert sessions == config.tasks_per_step * config.samples  # every admitted group whole
        assert record.lag is not None and record.lag <= config.max_lag
    assert math.isfinite(result.reward_before) and math.isfinite(result.reward_after)
    assert 0.0 <= result.wait_share <= 1.0
    saved = json.loads((tmp_path / "run" / "result.json").read_text())
    assert saved["reward_after"] == result.reward_after and len(saved["records"]) == 3
    with pytest.raises(ValueError, match="is not empty"):
        example.run(config)


class FaultedPool:
    """Draws through a rollout pool whose first ``losses`` draws of each seed fail as the pool fails a draw whose
    server it set aside (a fault injected at a chosen draw); then the draw answers with its seed's digits."""

    def __init__(self, losses: int):
        self.losses, self.asked = losses, {}

    def submit(self, ids, max_new_tokens, seed):
        self.asked[seed] = self.asked.get(seed, 0) + 1
        future = Future()
        if self.asked[seed] <= self.losses:
            future.set_exception(ServerDied(f"rollout server 0 was set aside (loss {self.asked[seed]} of seed {seed})"))
        else:
            future.set_result(SimpleNamespace(ids=[ord(c) for c in str(seed % 10)]))
        return future


def test_a_held_out_draw_is_drawn_again_as_long_as_servers_are_lost_within_its_patience(monkeypatch):
    """A chaos run lost the servers of one held-out draw four times in one measurement: the draw is drawn again for
    DRAW_PATIENCE seconds whatever the count, then fails naming the draw."""
    rows = [{"data_source": "dew/word_problems", "ground_truth": str(i), "extra_info": {}} for i in range(3)]
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
    pool = FaultedPool(losses=6)
    summary = rlvr_recipe.measure_reward(pool, LastNumberReward(), decode, rows, [[1, 2]] * 3, samples=2,
                                         max_new_tokens=4, seed=0, eos_ids=[])
    assert set(pool.asked.values()) == {7}  # each of the 6 draws was lost 6 times, then answered
    seeds = sorted(pool.asked)
    expected = [float(str(seeds[2 * row + s] % 10) == str(row)) for row in range(3) for s in range(2)]
    assert summary["all"] == pytest.approx(np.mean(expected))
    monkeypatch.setattr(rlvr_recipe, "DRAW_PATIENCE", 0.0)
    with pytest.raises(RuntimeError, match="held-out draw 0 of row 0 lost its server 1 time\\(s\\) in 0 s "
                                           "\\(DRAW_PATIENCE\\); the last: rollout server 0 was set aside"):
        rlvr_recipe.measure_reward(FaultedPool(losses=6), LastNumberReward(), decode, rows[:1], [[1, 2]],
                                   samples=1, max_new_tokens=4, seed=0, eos_ids=[])
