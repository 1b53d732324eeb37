r"""Verifiable rewards with dew's reward signature: ``MathReward`` and ``CodeReward``.

Both are called as ``reward(data_source, completion, ground_truth, extra_info) -> float``
(what :class:`~dew.collection.sampled_rollout.SampledRollout` and
:class:`~dew.collection.sources.PromptSource` call), keep no state between calls and may be
called from several threads at once.

``MathReward`` reads the last ``\boxed{...}`` answer and compares it with the reference
as an exact rational (``fractions.Fraction``), with a normalized-string fallback for
answers that are not numbers. It is deliberately small: no computer algebra, so
equivalent expressions written differently (``\frac{\pi}{2}`` and ``\pi/2``,
``2\sqrt{2}`` and ``\sqrt{8}``) do not match. tools/parity_math.py records where it
differs from Hugging Face's math-verify and why.

``CodeReward`` runs the last fenced python block of a completion once per stdin/stdout
test case through a sandbox fleet (``fleet.map(programs) -> outcomes``, see
dew/sandbox/fleet.py). What is isolated is the fleet's runner's business: with
``ProcessRunner`` the program keeps the caller's user, filesystem and network, so
untrusted model code needs ``BwrapRunner`` or ``ContainerRunner``.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Sequence
from fractions import Fraction

from dew.sandbox.program import Program, Verdict

# ---------------------------------------------------------------------------- math

_BOXED = re.compile(r"\\boxed\s*\{")
_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_SPACING = re.compile(r"\\(?:left|right)\s*\.|\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big|displaystyle)(?![A-Za-z])"
                      r"|\\[,;:! ]|\\q?quad(?![A-Za-z])|~")
_DEGREES = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![A-Za-z])|°")
_PERCENT = re.compile(r"(?:\\%|%)$")
_ASSIGNMENT = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*=(?!=)")
_UNITS = re.compile(r"\\(?:text|mbox)\s*\{[^{}]*\}(?:\^\{?\d\}?)?$")
_TEXT = re.compile(r"\\(?:text|textbf|textit|textrm|mbox|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")
_COMMAND_ARGUMENTS = re.compile(r"\\(?:frac|sqrt)(?![A-Za-z])")
# A plain decimal: digits with optional thousands separators (a comma and exactly three
# digits after a group of one to three), an optional fraction part, an optional exponent.
_DECIMAL = re.compile(r"([+-]?)((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?")
_SCIENTIFIC = re.compile(r"(.+?)(?:\\times|\\cdot|\*|x)10\^(?:\{([+-]?\d+)\}|(\d))")
_POWER = re.compile(r"(\d+(?:\.\d+)?)\^(?:\{([+-]?\d+)\}|(\d))")
_MIXED = re.compile(r"([+-]?)(\d+)\\frac\{(\d+)\}\{(\d+)\}")
_LARGEST_EXPONENT = 1000  # keeps 1e999999999 from building a huge integer


def last_boxed(text: str) -> str | None:
    r"""The content of the last top-level ``\boxed{...}`` in ``text``, or None.

    Braces are balanced (``\{`` and ``\}`` are escaped characters, not groups), so
    ``\boxed{\frac{1}{2}}`` gives ``\frac{1}{2}``; a box inside a box belongs to its
    outer box. None when there is no box or the last one never closes.
    """
    answer, start = None, 0
    while (found := _BOXED.search(text, start)) is not None:
        end = _closing_brace(text, found.end() - 1)
        if end is None:
            return None
        answer, start = text[found.end():end], end + 1
    return answer


def _closing_brace(text: str, opening: int) -> int | None:
    """The index of the brace that closes the one at ``opening``, skipping escaped characters."""
    depth, index = 0, opening
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return index
        index += 1
    return None


def _brace_arguments(text: str) -> str:
    r"""``\frac12`` -> ``\frac{1}{2}``, ``\sqrt2`` -> ``\sqrt{2}``: single-character arguments get braces."""
    out, index = [], 0
    while (found := _COMMAND_ARGUMENTS.search(text, index)) is not None:
        out.append(text[index:found.end()])
        index = found.end()
        if text.startswith("[", index) and "]" in text[index:]:  # \sqrt[3]{x}
            close = text.index("]", index)
            out.append(text[index:close + 1])
            index = close + 1
        for _ in range(2 if found.group() == "\\frac" else 1):
            while index < len(text) and text[index].isspace():
                index += 1
            if index < len(text) and text[index] == "{":
                close = _closing_brace(text, index)
                if close is None:
                    break
                out.append("{" + _brace_arguments(text[index + 1:close]) + "}")
                index = close + 1
            elif index < len(text) and text[index] not in "}\\":
                out.append("{" + text[index] + "}")
                index += 1
            else:
                break
    out.append(text[index:])
    return "".join(out)


def _clean(text: str) -> tuple[str, bool]:
    """The answer without LaTeX decoration and whitespace, and whether it ended in a percent sign."""
    text = text.replace("\u2212", "-").replace("\\$", "").strip()
    unwrapped = True
    while unwrapped:
        unwrapped = False
        for left, right in _DELIMITERS:
            if len(text) >= len(left) + len(right) and text.startswith(left) and text.endswith(right):
                text, unwrapped = text[len(left):len(text) - len(right)].strip(), True
                break
    text = _SPACING.sub("", text)
    text = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", text)
    text = _brace_arguments(text).replace("{,}", ",")
    text = _DEGREES.sub("", text)
    text = re.sub(r"\s+", "", text).rstrip(".")
    percent = _PERCENT.search(text) is not None
    if percent:
        text = _PERCENT.sub("", text)
    assignment = _ASSIGNMENT.match(text)
    if assignment and assignment.end() < len(text):
        text = text[assignment.end():]
    return text, percent


def _number(text: str) -> Fraction | None:
    """``text`` (cleaned) as an exact rational, or None when it is not a plain number."""
    if text.startswith("{") and _closing_brace(text, 0) == len(text) - 1:
        return _number(text[1:-1])
    if text.startswith("(") and text.endswith(")") and "," not in text:
        return _number(text[1:-1])
    if (decimal := _DECIMAL.fullmatch(text)) is not None:
        sign, digits, exponent = decimal.groups()
        value = _scaled(Fraction(digits.replace(",", "").rstrip(".")), Fraction(10), exponent or "0")
        return -value if sign == "-" and value is not None else value
    if (mixed := _MIXED.fullmatch(text)) is not None:
        sign, whole, numerator, denominator = mixed.groups()
        if int(denominator) == 0:
            return None
        value = int(whole) + Fraction(int(numerator), int(denominator))
        return -value if sign == "-" else value
    if text[:1] in ("+", "-") and text[1:2] not in ("", "+", "-"):
        value = _number(text[1:])
        return None if value is None else (-value if text[0] == "-" else value)
    if text.startswith("\\frac{"):
        middle = _closing_brace(text, 5)
        last = _closing_brace(text, middle + 1) if middle is not None and text.startswith("{", middle + 1) else None
        if last == len(text) - 1:
            return _ratio(_number(text[6:middle]), _number(text[middle + 2:-1]))
    if text.count("/") == 1:
        numerator, denominator = text.split("/")
        return _ratio(_number(numerator), _number(denominator))
    if (scientific := _SCIENTIFIC.fullmatch(text)) is not None:
        return _scaled(_number(scientific.group(1)), Fraction(10), scientific.group(2) or scientific.group(3))
    if (power := _POWER.fullmatch(text)) is not None:
        return _scaled(Fraction(1), Fraction(power.group(1)), power.group(2) or power.group(3))
    return None


def _scaled(mantissa: Fraction | None, base: Fraction, exponent: str) -> Fraction | None:
    """mantissa * base ** exponent, or None for a missing mantissa, 0 to a negative power or a huge exponent."""
    if mantissa is None or abs(int(exponent)) > _LARGEST_EXPONENT or (base == 0 and int(exponent) < 0):
        return None
    return mantissa * base ** int(exponent)


def _ratio(numerator: Fraction | None, denominator: Fraction | None) -> Fraction | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _top_level_items(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and braces."""
    items, depth, start, index = [], 0, 0, 0
    while index < len(text):
        char = text[index]
        if char == "\\" and text[index + 1:index + 2] in ("{", "}"):
            depth += 1 if text[index + 1] == "{" else -1
            index += 2
            continue
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
        index += 1
    items.append(text[start:])
    return items


def _item(text: str):
    value = _number(text)
    return ("number", value) if value is not None else ("text", _TEXT.sub(r"\1", text))


def _keys(text: str, percent: bool) -> set:
    """What an answer may stand for: equal answers share a key (see MathReward's rules)."""
    value = _number(text)
    if value is None and (units := _UNITS.search(text)) is not None and units.start() > 0:
        value = _number(text[:units.start()])
    if value is not None:
        return {("number", value), ("number", value / 100)} if percent else {("number", value)}
    suffix = "%" if percent else ""
    bracketed = _bracketed(text)
    if bracketed is not None and len(items := _top_level_items(bracketed[1])) >= 2:
        opener, _, closer = bracketed
        if opener == "\\{":
            return {("set", _multiset(items), suffix)}
        return {("sequence", opener, closer, tuple(_item(item) for item in items), suffix)}
    if len(items := _top_level_items(text)) >= 2:
        return {("set", _multiset(items), suffix)}
    return {("text", _TEXT.sub(r"\1", text) + suffix)}


def _multiset(items: list[str]) -> tuple:
    return tuple(sorted((_item(item) for item in items), key=repr))


def _bracketed(text: str) -> tuple[str, str, str] | None:
    r"""(opener, inside, closer) when one bracket pair encloses ``text``: ``(a,b)``, ``[a,b)``, ``\{a,b\}``."""
    opener = next((o for o in ("\\{", "(", "[") if text.startswith(o)), None)
    closer = next((c for c in ("\\}", ")", "]") if text.endswith(c)), None)
    if opener is None or closer is None or (opener == "\\{") != (closer == "\\}"):
        return None
    inside = text[len(opener):len(text) - len(closer)]
    return (opener, inside, closer) if inside and _balanced(inside) else None


def _balanced(text: str) -> bool:
    """Whether no bracket in ``text`` closes one that was opened before it: ``1),(2`` is not one interval."""
    depth = 0
    for char in text:
        depth += 1 if char in "([{" else -1 if char in ")]}" else 0
        if depth < 0:
            return False
    return depth == 0


def math_answers_match(answer: str, reference: str) -> bool:
    """Whether two answers are equal under MathReward's rules (both sides cleaned the same way)."""
    answer_text, answer_percent = _clean(answer)
    reference_text, reference_percent = _clean(reference)
    if not answer_text or not reference_text:
        return False
    return bool(_keys(answer_text, answer_percent) & _keys(reference_text, reference_percent))


class MathReward:
    r"""1.0 when the last ``\boxed{...}`` answer of a completion equals the ground truth, else 0.0.

    Rules, applied to the answer and the reference alike:

    - The answer is the content of the last top-level ``\boxed{...}`` (balanced braces,
      nested groups such as ``\boxed{\frac{1}{2}}``; ``\boxed {x}`` with a space too).
      No box, an empty box or a last box that never closes scores 0.0. Nothing raises
      on any completion. The reference is the whole ground truth, or its last box when
      it holds one.
    - Decoration is removed: surrounding ``$...$``, ``$$...$$``, ``\(...\)``, ``\[...\]``;
      ``\left``, ``\right``, ``\big`` and friends, ``\displaystyle``, the spacing commands
      ``\, \; \: \! \quad`` and ``~``; ``\$``; degrees ``^\circ``; all whitespace; trailing
      periods; a leading single-letter assignment ``x =`` (``x = 5`` reads as ``5``).
      ``\dfrac`` and ``\tfrac`` are ``\frac``; single-character arguments get braces
      (``\frac12`` is ``\frac{1}{2}``, ``\sqrt2`` is ``\sqrt{2}``); ``\text{...}``,
      ``\mathrm{...}`` and similar wrappers are unwrapped; the Unicode minus is ``-``.
    - Numbers compare as exact rationals: integers and decimals with an optional sign
      (``+3``, ``-3.0``, ``.5``, ``-0`` is 0), ``a/b``, ``\frac{a}{b}`` (signs inside or
      before), mixed numbers ``2\frac{1}{2}`` = 5/2 (the sign applies to the whole),
      scientific notation ``1e-3``, ``1.5\times10^{3}``, ``1.5\cdot10^3`` and integer
      powers ``10^{6}``, a number in one pair of parentheses or braces, and a number
      followed by units in ``\text{}`` or ``\mbox{}`` (``5\text{ cm}^2`` is 5, while
      ``2\mathrm{e}`` stays text). Exact means exact: 0.333 is not 1/3. Exponents beyond 1000 are not read.
    - Thousands separators: a comma is one only between digit groups where every group
      after the first has exactly three digits and the first has one to three, so
      ``1,000`` and ``1{,}000`` are 1000 (``1\,000`` too, the thin space being dropped),
      while ``1,5`` and ``1,0000`` are not numbers but lists (next rule).
    - A percentage ``p\%`` (or ``p%``) stands for both p and p/100, on either side:
      ``50\%`` matches 50 (how "what percent" answers are usually written) and 0.5 (its
      value), but 5% does not match 0.5.
    - Lists: ``(a, b)`` and ``[a, b)`` (points, tuples, intervals) compare item by item
      with their brackets; ``\{a, b\}`` (sets) and a bare ``a, b`` (lists of solutions)
      compare as multisets. Items compare by the number rule, else as text.
    - Anything else (``\sqrt{2}``, ``\pi``, expressions, ``\text{yes}``) compares as the
      cleaned string, case-sensitive: ``\sqrt2`` matches ``\sqrt{2}`` and ``2 \pi``
      matches ``2\pi``, but ``x^2+1`` does not match ``1+x^2``.
    """

    def __call__(self, data_source: str, completion: str, ground_truth: str, extra_info: str) -> float:
        if not isinstance(ground_truth, str):
            raise ValueError(f"MathReward needs the reference answer as a string ground_truth, got {ground_truth!r}")
        reference = last_boxed(ground_truth) if _BOXED.search(ground_truth) else ground_truth
        if reference is None or not _clean(reference)[0]:
            raise ValueError(f"MathReward's ground_truth holds no reference answer: {ground_truth!r}")
        if not isinstance(completion, str):
            return 0.0
        answer = last_boxed(completion)
        if answer is None:
            return 0.0
        try:
            return float(math_answers_match(answer, reference))
        except (RecursionError, ValueError, OverflowError, ZeroDivisionError):  # pathological nesting or digits
            return 0.0

    def __repr__(self) -> str:
        return "MathReward()"


_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM8K_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
GSM8K_CLIP_CHARS = 300  # verl reads only a completion's last 300 characters (its regexes are slow on long text)


class GSM8KReward:
    """verl's GSM8K rule (``verl/utils/reward_score/gsm8k.py``, v0.5): 1.0 when the completion's answer equals
    the ground truth as text, else 0.0.

    ``"strict"`` (verl's default) reads the last ``#### <number>`` of the completion's last
    300 characters, so the format is part of the task; ``"flexible"`` reads the last number
    there. Commas and dollar signs are dropped from the answer before comparing.
    """

    def __init__(self, method: str = "strict"):
        if method not in ("strict", "flexible"):
            raise ValueError(f"GSM8KReward: method must be 'strict' or 'flexible', got {method!r}")
        self.method = method

    def answer(self, completion: str) -> str | None:
        text = completion[-GSM8K_CLIP_CHARS:]
        if self.method == "strict":
            found = _GSM8K_STRICT.findall(text)
            return found[-1].replace(",", "").replace("$", "") if found else None
        return next((number for number in reversed(_GSM8K_NUMBER.findall(text)) if number not in ("", ".")), None)

    def __call__(self, data_source: str, completion: str, ground_truth: str, extra_info: str) -> float:
        if not isinstance(ground_truth, str) or not ground_truth:
            raise ValueError(f"GSM8KReward needs the answer as a non-empty string ground_truth, got {ground_truth!r}")
        if not isinstance(completion, str):
            return 0.0
        return float(self.answer(completion) == ground_truth)

    def __repr__(self) -> str:
        return f"GSM8KReward({self.method!r})"


_LAST_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")  # 1,200 or 1200; "1,9" is 1 then 9


class LastNumberReward:
    """1.0 when the completion's last number equals the ground truth as a number, else 0.0 (the built-in word
    problems' rule, :mod:`dew.data.word_problems`).

    A number is an optional minus sign and digits, with thousands commas and a decimal part allowed
    ("1,200", "3.50"; "1,9" is two numbers); a full stop after it is punctuation ("... 15 apples. The
    answer is 15." reads 15).
    The ground truth must be a number.
    """

    def answer(self, completion: str) -> Fraction | None:
        found = _LAST_NUMBER.findall(completion)
        return Fraction(found[-1].replace(",", "")) if found else None

    def __call__(self, data_source: str, completion: str, ground_truth: str, extra_info: str) -> float:
        try:
            truth = Fraction(str(ground_truth).replace(",", ""))
        except ValueError:
            raise ValueError(f"LastNumberReward needs a number as ground_truth, got {ground_truth!r}") from None
        if not isinstance(completion, str):
            return 0.0
        return float(self.answer(completion) == truth)

    def __repr__(self) -> str:
        return "LastNumberReward()"


# ---------------------------------------------------------------------------- code

_OPENING_FENCE = re.compile(r"[ \t]*(`{3,})[ \t]*([^\s`]*)[^`]*")
_PYTHON_TAGS = frozenset({"python", "py", "python3"})


def last_python_block(text: str) -> str | None:
    """The code of the last closed fenced block tagged python, py or python3 (any case), or None.

    A fence is a line of three or more backticks followed by the tag; the block closes at
    the next line holding only at least as many backticks. Untagged fences and other
    languages do not count (they hold sample input and output as often as code); a
    fence that never closes (a truncated completion) is not a block, and nothing after
    it is read. The common indentation of the block's lines is removed.
    """
    lines, index, block = text.split("\n"), 0, None
    while index < len(lines):
        opening = _OPENING_FENCE.fullmatch(lines[index])
        if opening is None:
            index += 1
            continue
        closing = re.compile(rf"[ \t]*`{{{len(opening.group(1))},}}[ \t]*")
        close = next((j for j in range(index + 1, len(lines)) if closing.fullmatch(lines[j])), None)
        if close is None:
            break
        if opening.group(2).lower() in _PYTHON_TAGS:
            block = textwrap.dedent("\n".join(lines[index + 1:close]) + "\n")
        index = close + 1
    return block


def read_cases(ground_truth: str) -> list[dict[str, str]]:
    """The ``[{"stdin": str, "stdout": str}, ...]`` cases of a ground truth; ValueError naming the problem."""
    try:
        cases = json.loads(ground_truth)
    except (TypeError, json.JSONDecodeError) as error:
        raise ValueError(f"CodeReward's ground_truth must be a JSON list of {{stdin, stdout}} cases; it is not JSON "
                         f"({error}): {str(ground_truth)[:80]!r}") from error
    if not isinstance(cases, list) or not cases:
        raise ValueError(f"CodeReward's ground_truth must be a non-empty JSON list of {{stdin, stdout}} cases, "
                         f"got {str(ground_truth)[:80]!r}")
    for number, case in enumerate(cases):
        if not isinstance(case, dict):
            raise ValueError(f"CodeReward's ground_truth case {number} must be an object with stdin and stdout, "
                             f"got {case!r:.80}")
        for field in ("stdin", "stdout"):
            if not isinstance(case.get(field), str):
                raise ValueError(f"CodeReward's ground_truth case {number}: {field} must be a string, "
                                 f"got {case.get(field)!r:.80}")
    return cases


def output_lines(text: str) -> list[str]:
    """The lines of a program's output as CodeReward compares them: trailing whitespace and blank lines dropped."""
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


class CodeReward:
    """The share of test cases that the completion's last python block passes.

    ``fleet``: anything with ``map(programs) -> outcomes`` in order, such as
    ``SandboxFleet(BwrapRunner(), limits=SandboxLimits(...), workers=N)``.
    ``argv``: how the block, written to ``main.py`` in a fresh directory, is run.

    The program is :func:`last_python_block` of the completion; with none the reward
    is 0.0 and nothing runs. The ground truth is a JSON list of ``{"stdin": str,
    "stdout": str}`` cases (other keys are ignored); a malformed one raises ValueError,
    being a dataset bug rather than a model failure. Each case runs once; it passes
    when the verdict is COMPLETED (exit status 0) and the output equals the expected
    one line by line, ignoring trailing whitespace on each line and trailing blank
    lines (leading whitespace and leading blank lines count). The reward is the share
    of cases passed, or with ``all_or_nothing=True`` 1.0 when all pass and else 0.0.
    A fleet that fails raises (the caller records the error; it is not a score).
    """

    def __init__(self, fleet, all_or_nothing: bool = False, argv: Sequence[str] = ("python3", "main.py")):
        if not callable(getattr(fleet, "map", None)):
            raise TypeError(f"fleet must have map(programs) -> outcomes (a dew.sandbox.SandboxFleet), got {fleet!r}")
        if not isinstance(all_or_nothing, bool):
            raise ValueError(f"all_or_nothing must be True or False, got {all_or_nothing!r}")
        Program(files={"main.py": ""}, argv=argv)  # refuses an argv that is not a non-empty list of strings
        self.fleet, self.all_or_nothing, self.argv = fleet, all_or_nothing, tuple(argv)

    def __call__(self, data_source: str, completion: str, ground_truth: str, extra_info: str) -> float:
        cases = read_cases(ground_truth)
        code = last_python_block(completion) if isinstance(completion, str) else None
        if code is None:
            return 0.0
        programs = [Program(files={"main.py": code}, argv=self.argv, stdin=case["stdin"]) for case in cases]
        outcomes = list(self.fleet.map(programs))
        if len(outcomes) != len(programs):
            raise RuntimeError(f"the fleet returned {len(outcomes)} outcomes for {len(programs)} programs")
        passed = sum(outcome.verdict == Verdict.COMPLETED
                     and output_lines(outcome.stdout) == output_lines(case["stdout"])
                     for outcome, case in zip(outcomes, cases))
        if self.all_or_nothing:
            return float(passed == len(cases))
        return passed / len(cases)

    def __repr__(self) -> str:
        return f"CodeReward({self.fleet!r}, all_or_nothing={self.all_or_nothing}, argv={self.argv!r})"
