"""The built-in tool environment of RLVR runs: a calculator the policy calls by writing ``calc(EXPRESSION)``.

``environment = "calculator"`` runs every prompt as a multi-turn episode
(:class:`~dew.collection.sources.EnvironmentSource`): the context starts as the prompt's
ids; a response (ended on EOS) that contains ``calc(...)`` is a tool call, and the
calculator appends the result as text, ``=47`` and a newline (or ``error: ...`` for an
expression it does not take), after the response's ids, for the next turn to read; a
response without a call is the answer, and the episode ends. The verifier scores that last
response with the run's reward, as a single-turn run scores its completion. A call on the
episode's last turn (``max_turns``) ends it truncated, and its last response is scored all
the same (a policy that never answers earns what its call text earns, usually 0).

Expressions are integers and decimals with ``+ - * / // % **`` and parentheses, at most
:data:`LONGEST` characters, exponents at most :data:`LARGEST_POWER` (Python's ``ast``, never
``eval``). ``metrics()`` reports ``tool_calls`` and ``tool_errors`` per episode.

The result goes into the context as plain text: right for the built-in character
tokenizer and any base model; a chat model's own environment would wrap it in its
template's tool turn. For the built-in tasks :func:`calculator_demonstrations` writes the
warm start's demonstrations with the call: "What is forty plus seven?" is answered
``calc(40+7)``, EOS, then (read, not trained) ``=47``, then `` \\boxed{47}`` and EOS;
code tasks are answered directly, as without the environment.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Sequence

from dew.collection.scoring import completion_ids, score_completion
from dew.data.chat import Role
from dew.data.verifiable import VerifiableTask
from dew.records.episode_protocol import Action, Environment, EpisodeStatus, Observation

CALL = "calc("
LONGEST = 64  # characters of an expression the calculator reads
LARGEST_POWER = 12  # the largest exponent of **: results stay small enough to print
RESULT = "={}\n"
ERROR = "error: {}\n"

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator does not take (what it says goes back to the policy)."""


def tool_call(text: str) -> str | None:
    """The expression of the first ``calc(...)`` in ``text`` (its parentheses balanced), or None without a call."""
    start = text.find(CALL)
    if start < 0:
        return None
    depth, begin = 1, start + len(CALL)
    for index in range(begin, len(text)):
        depth += {"(": 1, ")": -1}.get(text[index], 0)
        if depth == 0:
            return text[begin:index]
    return text[begin:]  # unclosed: evaluated as written, and refused if it does not parse


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalculatorError saying what it does not take."""
    if len(expression) > LONGEST:
        raise CalculatorError(f"longer than {LONGEST} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError("not an expression") from None

    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > LARGEST_POWER:
                raise CalculatorError(f"an exponent past {LARGEST_POWER}")
            try:
                return _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
        raise CalculatorError("only numbers, + - * / // % ** and parentheses")

    result = value(tree)
    if isinstance(result, complex):
        raise CalculatorError("not a real number")
    return result


def show(value: int | float) -> str:
    """A result as the calculator writes it: an integer without a point, else up to 6 decimals."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6f}".rstrip("0").rstrip(".")


class CalculatorEnvironment(Environment):
    """One episode of the calculator (see the module docstring): ``prompt`` ids, ``encode``/``decode`` text."""

    def __init__(self, prompt: Sequence[int], encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 eos_ids: Sequence[int], max_turns: int):
        self.prompt, self.encode, self.decode = tuple(int(i) for i in prompt), encode, decode
        self.eos_ids, self.max_turns = frozenset(eos_ids), max_turns
        self.turns = self.calls = self.errors = 0

    def reset(self) -> Observation:
        return Observation(self.prompt)

    def step(self, action: Action) -> Observation:
        self.turns += 1
        after = action.context + action.tokens
        expression = tool_call(self.decode(completion_ids(action.tokens, self.eos_ids)))
        if expression is None:
            return Observation(after, EpisodeStatus.COMPLETED, "answered")
        self.calls += 1
        if self.turns >= self.max_turns:
            return Observation(after, EpisodeStatus.TRUNCATED, f"a call on the last of max_turns={self.max_turns}")
        try:
            text, detail = RESULT.format(show(evaluate(expression))), f"calc({expression})"
        except CalculatorError as error:
            self.errors += 1
            text, detail = ERROR.format(error), f"calc({expression}) refused: {error}"
        return Observation(after + tuple(self.encode(text)), EpisodeStatus.RUNNING, detail)

    def metrics(self) -> dict[str, float]:
        return {"tool_calls": float(self.calls), "tool_errors": float(self.errors)}


class Calculator:
    """The calculator's ``(environment, verifier)`` for EnvironmentSource, built from a run's environment setup.

    ``setup`` (:class:`~dew.recipes.run_environment.EnvironmentSetup`) gives the tokenizer,
    the run's reward, the EOS ids and ``max_turns``. ``environment(task, identity)`` opens an
    episode on the task's ``prompt_ids``; ``verifier(task, episode)`` scores the last response
    with the reward and the task's ``data_source``, ``ground_truth`` and ``extra_info``.
    """

    def __init__(self, setup):
        self.setup = setup

    def environment(self, task, identity) -> CalculatorEnvironment:
        tokenizer = self.setup.tokenizer
        return CalculatorEnvironment(task.data["prompt_ids"],
                                     lambda text: tokenizer.encode(text, add_special_tokens=False),
                                     lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                     self.setup.eos_ids, self.setup.max_turns)

    def verifier(self, task, episode) -> float:
        last = episode.transitions[-1].action.tokens if episode.transitions else ()
        return score_completion(self.setup.reward, lambda ids: self.setup.tokenizer.decode(ids, skip_special_tokens=True),
                                last, self.setup.eos_ids, task.data)


def calculator(setup) -> tuple[Callable, Callable]:
    """The built-in environment factory (``environment = "calculator"``): ``(environment, verifier)``."""
    built = Calculator(setup)
    return built.environment, built.verifier


def calculator_demonstrations(tokenizer, tasks: Sequence[VerifiableTask]) -> tuple[list[list[int]], list[list[int]]]:
    """(ids, roles) per built-in task, as the calculator's episodes run: a math task calls the tool first
    (``calc(a+b)``, EOS; the result, as TOOL; the task's answer, EOS), a code task answers directly."""
    documents, roles = [], []
    eos = [tokenizer.eos_token_id]

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    for task in tasks:
        prompt = encode(task.prompt)
        parts = [(prompt, Role.USER)]
        if task.family == "math":
            expression = f"{task.extra_info['a']}{task.extra_info['op']}{task.extra_info['b']}"
            parts += [(encode(f"{CALL}{expression})") + eos, Role.ASSISTANT),
                      (encode(RESULT.format(show(evaluate(expression)))), Role.TOOL)]
        parts.append((encode(task.answer) + eos, Role.ASSISTANT))
        documents.append([i for ids, _ in parts for i in ids])
        roles.append([int(role) for ids, role in parts for _ in ids])
    return documents, roles
