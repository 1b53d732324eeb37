"""MathReward against its rules and math-verify's recorded verdicts; CodeReward's extraction, matching and
ground truth checks on a fake fleet and a real one; both as SampledRollout's reward."""

import contextlib
import io
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.data.prompts import utf8_column
from dew.collection.sampled_rollout import SampledRollout
from dew.objectives.grpo import GRPOObjective
from dew.sandbox import (
    CodeReward,
    ContainerRunner,
    MathReward,
    Outcome,
    ProcessRunner,
    SandboxFleet,
    SandboxLimits,
    Verdict,
)
from dew.sandbox.verifiable_rewards import last_boxed, last_python_block, output_lines

ROOT = Path(__file__).resolve().parents[1]
MATH_VERIFY = json.loads((ROOT / "tests" / "fixtures" / "math_verify.json").read_text())


def score(completion, ground_truth):
    return MathReward()("math", completion, ground_truth, "")


def test_math_reward_follows_its_rules_and_reports_where_math_verify_differs():
    """Every row of tools/parity_math.py: MathReward gives the expected verdict, and a row says why
    exactly when math-verify's recorded verdict is another."""
    wrong, differences = [], []
    for row in MATH_VERIFY["rows"]:
        got = score(row["completion"], row["reference"])
        if got != float(row["expected"]):
            wrong.append(f"{row['completion']!r} vs {row['reference']!r}: {got}, expected {row['expected']}")
        assert bool(row["why"]) == (row["math_verify"] != row["expected"]), row
        if row["why"]:
            differences.append(f"  {row['completion']!r} vs {row['reference']!r}: MathReward {row['expected']}, "
                               f"math-verify {row['math_verify']} ({row['why']})")
    print(f"\n{len(differences)} of {len(MATH_VERIFY['rows'])} pairs differ from math-verify "
          f"{MATH_VERIFY['versions']['math-verify']}:\n" + "\n".join(differences))
    assert len(MATH_VERIFY["rows"]) >= 40
    assert not wrong, "\n".join(wrong)


def test_the_last_top_level_box_is_the_answer():
    assert last_boxed(r"so \boxed{\frac{1}{2}} and \boxed{\dfrac{\sqrt{3}}{2}}.") == r"\dfrac{\sqrt{3}}{2}"
    assert last_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"  # escaped braces are characters, not groups
    assert last_boxed(r"\boxed{x = \boxed{3}} then") == r"x = \boxed{3}"  # a box inside a box is part of it
    assert last_boxed(r"\boxed {7}") == "7"
    assert last_boxed(r"\boxed{1} and \boxed{2") is None  # the last box never closes: no answer
    assert last_boxed("no box here") is None
    assert score(r"\boxed{3} no wait, \boxed{\frac{1}{2}}", "0.5") == 1.0
    assert score(r"\boxed{\frac{1}{2}} no wait, \boxed{3}", "0.5") == 0.0
    assert score(r"$\boxed{\left[ \tfrac{1}{2}, \frac{3}{2} \right)}$", "[0.5, 1.5)") == 1.0
    assert score("the answer is 5", "5") == 0.0  # no box
    assert score(r"\boxed{5}", r"The solution gives \boxed{5}.") == 1.0  # a boxed reference: its last box


@pytest.mark.parametrize("completion", [
    "", "\\boxed{", "\\boxed{}", "\\boxed{ }", "}{\\boxed}", "\\boxed{}}}", "\\boxed{$}", "\\boxed{\\frac{1}{0}}",
    "\\boxed{1/0}", "\\boxed{0^{-1}}", "\\boxed{1e999999999}", "\\boxed{10^{99999999}}", "\\boxed{" + "9" * 10000 + "}",
    "\\boxed{" + "{" * 5000 + "}" * 5000 + "}", "\\boxed{" + "\\frac{" * 3000 + "}" * 3000 + "}",
    "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}", "\\boxed{\\frac}", "\\boxed{\\sqrt[}", "\\boxed{--1}",
    "\\boxed{\\left(}", "\\boxed{\\frac{1}\\{}", "\\boxed{%}", "\\boxed{\\text{}}", "\\boxed{1,2,}", "\\boxed{\\{\\}}", None, 12,
])
def test_malformed_answers_score_zero_and_never_raise(completion):
    assert score(completion, "1") == 0.0


def test_a_missing_reference_is_a_dataset_error():
    for ground_truth in ("", "  ", "$ $", r"\boxed{}", r"\boxed{1", None):
        with pytest.raises(ValueError, match="ground_truth"):
            score(r"\boxed{1}", ground_truth)


class FakeFleet:
    """Runs each program's main.py in this process with exec (the tests' own code only) and records the programs."""

    def __init__(self):
        self.programs = []

    def map(self, programs):
        self.programs.extend(programs)
        return [self._run(program) for program in programs]

    @staticmethod
    def _run(program):
        stdout, stdin = io.StringIO(), sys.stdin
        sys.stdin = io.StringIO(program.stdin)
        try:
            with contextlib.redirect_stdout(stdout):
                exec(compile(program.files["main.py"], "main.py", "exec"), {"__name__": "__main__"})
            verdict, code = Verdict.COMPLETED, 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
            verdict = Verdict.COMPLETED if code == 0 else Verdict.FAILED
        except Exception:
            verdict, code = Verdict.FAILED, 1
        finally:
            sys.stdin = stdin
        return Outcome(verdict, code, stdout.getvalue(), "", 0.0)


ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
CASES = json.dumps([{"stdin": "2 3\n", "stdout": "5\n"}, {"stdin": "10 -4", "stdout": "6"},
                    {"stdin": "1 1\n", "stdout": "3\n", "note": "other keys are ignored"}])


def test_the_last_closed_python_block_is_the_program():
    assert last_python_block("```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```") == "print(2)\n"
    assert last_python_block("```Python3 main.py\nprint(3)\n```") == "print(3)\n"  # tag case and info string
    assert last_python_block("```python\nprint(1)\n```\n```\n5\n```") == "print(1)\n"  # bare fences are not code
    assert last_python_block("```python\nprint(1)\n```\n```text\n5\n```") == "print(1)\n"
    assert last_python_block("```\nprint(1)\n```") is None
    assert last_python_block("```python\nprint(1)\n```\n```python\nprint(2)") == "print(1)\n"  # unclosed: not a block
    assert last_python_block("````python\ns = '''\n```\n'''\nprint(s)\n````") == "s = '''\n```\n'''\nprint(s)\n"
    assert last_python_block("1. run:\n   ```python\n   if True:\n       print(4)\n   ```") == "if True:\n    print(4)\n"
    assert last_python_block("inline ```python print(1)``` only") is None
    assert last_python_block("no code") is None


def test_outputs_match_line_by_line_ignoring_trailing_whitespace_and_blank_lines():
    assert output_lines("5  \r\n6\t\n\n\n") == output_lines("5\n6") == ["5", "6"]
    assert output_lines(" 5\n6") != output_lines("5\n6")  # leading whitespace counts
    assert output_lines("\n5\n6") != output_lines("5\n6")  # so do leading blank lines
    assert output_lines("5\n\n6") != output_lines("5\n6")  # and blank lines inside


def test_code_reward_is_the_share_of_passed_cases():
    fleet = FakeFleet()
    assert CodeReward(fleet)("code", "Here:\n" + ADD, CASES, "") == pytest.approx(2 / 3)  # 5, 6 right; 2 != 3
    assert [p.stdin for p in fleet.programs] == ["2 3\n", "10 -4", "1 1\n"]
    assert all(p.files == {"main.py": "a, b = map(int, input().split())\nprint(a + b)\n"} for p in fleet.programs)
    assert all(tuple(p.argv) == ("python3", "main.py") for p in fleet.programs)
    assert CodeReward(fleet, all_or_nothing=True)("code", ADD, CASES, "") == 0.0
    two = json.dumps(json.loads(CASES)[:2])
    assert CodeReward(fleet, all_or_nothing=True)("code", ADD, two, "") == 1.0
    # The right output with a non-zero exit status does not pass.
    failing = "```python\nimport sys\na, b = map(int, input().split())\nprint(a + b)\nsys.exit(3)\n```"
    assert CodeReward(fleet)("code", failing, two, "") == 0.0
    assert CodeReward(FakeFleet(), argv=("python3", "-I", "main.py"))("code", ADD, two, "") == 1.0


def test_no_code_block_scores_zero_without_running_anything():
    fleet = FakeFleet()
    reward = CodeReward(fleet)
    for completion in ("print(5)", "```\nprint(5)\n```", "```python\nprint(5)", None):
        assert reward("code", completion, CASES, "") == 0.0
    assert fleet.programs == []


@pytest.mark.parametrize("ground_truth, message", [
    ("not json", "it is not JSON"),
    ('{"stdin": "", "stdout": ""}', "non-empty JSON list"),
    ("[]", "non-empty JSON list"),
    ('["5"]', "case 0 must be an object"),
    ('[{"stdin": "", "stdout": "1"}, {"stdin": 5, "stdout": "1"}]', "case 1: stdin must be a string, got 5"),
    ('[{"stdin": ""}]', "case 0: stdout must be a string, got None"),
    (None, "it is not JSON"),
])
def test_a_malformed_ground_truth_raises_naming_the_problem(ground_truth, message):
    fleet = FakeFleet()
    with pytest.raises(ValueError, match=message):
        CodeReward(fleet)("code", ADD, ground_truth, "")
    with pytest.raises(ValueError, match=message):  # a dataset bug shows even when the model wrote no code
        CodeReward(fleet)("code", "no code", ground_truth, "")
    assert fleet.programs == []


def test_code_reward_options_are_checked():
    with pytest.raises(TypeError, match="fleet must have map"):
        CodeReward(object())
    with pytest.raises(ValueError, match="all_or_nothing must be True or False, got 'yes'"):
        CodeReward(FakeFleet(), all_or_nothing="yes")
    with pytest.raises(ValueError, match="argv must be a non-empty sequence of strings"):
        CodeReward(FakeFleet(), argv="python3 main.py")


@pytest.mark.parametrize("kind", ["process", "container"])
def test_code_reward_through_a_real_fleet(kind, request):
    runner = ContainerRunner(request.getfixturevalue("container_image")) if kind == "container" else ProcessRunner()
    limits = SandboxLimits(cpu_seconds=5, wall_seconds=20)
    with SandboxFleet(runner, limits=limits, workers=2) as fleet:
        assert CodeReward(fleet)("code", ADD, CASES, "") == pytest.approx(2 / 3)
        crash = "```python\nprint(5)\nraise SystemExit(1)\n```"
        assert CodeReward(fleet)("code", crash, CASES, "") == 0.0
        assert CodeReward(fleet, all_or_nothing=True)("code", ADD, json.dumps(json.loads(CASES)[:2]), "") == 1.0


def parity_rollout(tiny_model, reward, ground_truth, decode):
    """SampledRollout with ``reward`` on completions whose answer is their first sampled id's parity;
    returns (its mean reward, the share of completions whose first id is odd)."""
    variables = jax.jit(tiny_model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    objective = GRPOObjective(tiny_model, seq_len=9)
    rollout = SampledRollout(objective, reward=reward, groups=4, max_new_tokens=3, decode=decode)
    batch = {"prompt": np.array([[3, 4, 5], [6, 7, 8]], np.int32), "prompt_length": np.array([3, 3], np.int32),
             "ground_truth": utf8_column([ground_truth] * 2)}
    packed = rollout(batch, variables, 0, jax.random.key(2))
    objective.validate(packed)
    firsts = [packed["input_ids"].ravel()[np.flatnonzero(packed["session_index"] == s)[0]] for s in range(8)]
    return rollout.metrics["reward/mean"], float(np.mean([int(i) % 2 for i in firsts]))


def test_both_rewards_serve_sampled_rollout(tiny_model):
    mean, odd = parity_rollout(tiny_model, MathReward(), r"\frac{2}{2}", lambda ids: f"Thus $\\boxed{{{ids[0] % 2}.0}}$.")
    assert 0 < odd < 1 and mean == pytest.approx(odd)  # both verdicts occur
    mean, odd = parity_rollout(tiny_model, CodeReward(FakeFleet()), json.dumps([{"stdin": "", "stdout": "1\n"}]),
                               lambda ids: f"```python\nprint({ids[0]} % 2)\n```")
    assert 0 < odd < 1 and mean == pytest.approx(odd)
