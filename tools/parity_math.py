r"""Record math-verify's verdicts on a table of (completion, reference) pairs.

Run in the reference environment (tools/requirements-ref.txt, which pins math-verify),
from the repository root:

    .venv-ref/bin/python tools/parity_math.py

Each row is a completion (mostly an answer wrapped in ``\boxed{}``), a reference answer,
MathReward's expected verdict under its documented rules (dew/sandbox/verifiable_rewards.py) and,
where that verdict differs from math-verify's, why. math-verify is called as its README
shows: ``verify(parse(f"${reference}$"), parse(completion))`` with default settings.
Writes tests/fixtures/math_verify.json with the table, math-verify's verdicts and its
version; tests/test_rewards.py checks MathReward against the expected column and
prints the differences. The script fails when a row's ``why`` disagrees with the
verdicts (a reason where both agree, or a difference without one).
"""

import json
from importlib.metadata import version
from pathlib import Path

from math_verify import parse, verify

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "math_verify.json"


def box(answer: str) -> str:
    return f"The answer is $\\boxed{{{answer}}}$."


EXACT = "MathReward compares exact rationals; math-verify rounds floats to 6 decimal places"
ALGEBRA = "MathReward has no computer algebra: non-numeric answers compare as cleaned strings"
# (completion, reference, MathReward's verdict, why it differs from math-verify or "")
TABLE = [
    # fractions, decimals, \frac forms
    (box("0.5"), r"\frac{1}{2}", True, ""),
    (box("1/2"), "0.5", True, ""),
    (box(r"\dfrac{1}{2}"), "1/2", True, ""),
    (box(r"\tfrac12"), "0.5", True, ""),
    (box(r"\frac12"), r"\frac{1}{2}", True, ""),
    (box(r"\frac{3}{6}"), r"\frac{1}{2}", True, ""),
    (box(".5"), r"\frac12", True, ""),
    (box(r"\frac{-1}{2}"), r"-\frac{1}{2}", True, ""),
    (box(r"\frac{1}{3}"), "0.333", False, ""),
    (box("0.3333333"), r"\frac{1}{3}", False, EXACT),
    (box("3"), "4", False, ""),
    # signs, integers written with .0, negative zero
    (box("-3"), "-3.0", True, ""),
    (box("+3"), "3", True, ""),
    (box("3.0"), "3", True, ""),
    (box("-3"), "3", False, ""),
    (box("-0"), "0", True, ""),
    (box("-0.0"), "0", True, ""),
    (box("12345678901234567890"), "12345678901234567891", False, ""),
    # thousands separators
    (box("1,000"), "1000", True, ""),
    (box("1{,}000"), "1000", True, ""),
    (box(r"1\,000"), "1000", True, "math-verify reads the thin space as a product, 1 * 000 = 0; MathReward drops it"),
    (box("1,000,000"), "1000000", True, ""),
    (box("1,5"), "1.5", False, ""),
    (box("1,0000"), "10000", False, ""),
    # percentages
    (box(r"50\%"), "50", True, ""),
    (box(r"50\%"), "0.5", True, ""),
    (box("0.5"), r"50\%", True, ""),
    (box(r"5\%"), "0.5", False, ""),
    # scientific notation and powers
    (box("1e-3"), "0.001", True, "math-verify reads e as Euler's number (e - 3); MathReward reads scientific notation"),
    (box(r"1.5 \times 10^{3}"), "1500", True, ""),
    (box("10^{-2}"), "0.01", True, ""),
    (box("2^{10}"), "1024", True, ""),
    # mixed numbers
    (box(r"2\frac{1}{2}"), r"\frac{5}{2}", True, ""),
    (box(r"-2\frac{1}{2}"), "-2.5", True, ""),
    # decoration: delimiters, \left \right, trailing period, units, degrees, currency, x =
    (box(r"\left( 3 \right)"), "3", True, ""),
    (box("7."), "7", True, "math-verify does not parse 7. with its trailing period; MathReward drops trailing periods"),
    (box(r"5 \text{ cm}"), "5", True, ""),
    (box(r"5\text{ cm}^2"), "5", True, ""),
    (box(r"30^\circ"), "30", True, ""),
    (box(r"\$18.00"), "18", True, ""),
    (box("x = 5"), "5", True, ""),
    # symbolic answers
    (box(r"\sqrt2"), r"\sqrt{2}", True, ""),
    (box(r"\sqrt{2}"), "1.41421356", False, "math-verify evaluates sqrt(2) and rounds; MathReward does not evaluate \\sqrt"),
    (box(r"2\sqrt{2}"), r"\sqrt{8}", False, ALGEBRA),
    (box(r"\pi"), r"\pi", True, ""),
    (box(r"2 \pi"), r"2\pi", True, ""),
    (box(r"\frac{\pi}{2}"), r"\pi/2", False, ALGEBRA),
    (box("3.14"), r"\pi", False, ""),
    (box("x^2 + 1"), "1 + x^2", False, ALGEBRA),
    (box(r"\infty"), r"\infty", True, ""),
    # intervals, tuples, sets, lists
    (box("[1, 2)"), "[1,2)", True, ""),
    (box(r"[\frac{1}{2}, 1)"), "[0.5, 1)", True, ""),
    (box("(1, 2)"), "[1, 2]", False, ""),
    (box(r"(-\infty, 0]"), r"(-\infty,0]", True, ""),
    (box("(1, 2)"), "(2, 1)", False, ""),
    (box(r"\{1, 2, 3\}"), r"\{3, 2, 1\}", True, ""),
    (box("2, 3"), "3, 2", True, ""),
    # text answers
    (box(r"\text{yes}"), r"\text{yes}", True, ""),
    (box(r"\text{Yes}"), r"\text{yes}", False, "math-verify lowercases text; MathReward compares text case-sensitively (a and A may be different variables)"),
    (box(r"\text{(B)}"), "B", False, "math-verify reads a multiple-choice letter out of (B); MathReward compares the text (B) with B"),
    # malformed and missing answers
    ("The answer is 1/2.", "1/2", False, "math-verify falls back to the last number in the text; MathReward needs a box"),
    (r"The answer is \boxed{1/2", "1/2", False, ""),
    (box(""), "0", False, ""),
    (box(r"\frac{1}{0}"), "0", False, ""),
    (r"First \boxed{3}, then \boxed{4}.", "4", True, "math-verify joins all boxes into the set {3, 4}; MathReward takes the last box"),
    (r"First \boxed{4}, then \boxed{3}.", "4", False, ""),
]


def main():
    rows = []
    for completion, reference, expected, why in TABLE:
        verdict = bool(verify(parse(f"${reference}$"), parse(completion)))
        if bool(why) != (verdict != expected):
            raise SystemExit(f"{completion!r} vs {reference!r}: math-verify says {verdict}, MathReward is expected to "
                             f"say {expected}, and the row's why is {why!r}; fix the row")
        rows.append({"completion": completion, "reference": reference, "expected": expected,
                     "math_verify": verdict, "why": why})
    versions = {name: version(name) for name in ("math-verify", "latex2sympy2_extended", "sympy")}
    lines = ",\n".join("  " + json.dumps(row, ensure_ascii=False) for row in rows)  # a row a line
    FIXTURE.write_text(f'{{"versions": {json.dumps(versions)},\n "rows": [\n{lines}\n]}}\n')
    differences = sum(row["why"] != "" for row in rows)
    print(f"{len(rows)} pairs, {differences} known differences from math-verify {version('math-verify')}; "
          f"wrote {FIXTURE.relative_to(Path.cwd()) if FIXTURE.is_relative_to(Path.cwd()) else FIXTURE}")


if __name__ == "__main__":
    main()
