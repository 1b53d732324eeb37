"""One-step word problems for a real chat model: the ``word`` family of :mod:`dew.data.verifiable`.

"Mia has 12 stickers and gets 7 more. How many stickers does Mia have now? Give the answer
as a number at the end." asked as a chat message (the row's ``prompt`` is a list of
messages, rendered by the model's chat template), with the answer (an integer) as the
ground truth, scored by :class:`~dew.sandbox.LastNumberReward`: 1.0 when the completion's
last number is the answer. Three operations, each with three wordings: adding (2..20 plus
2..20), taking away (10..30 minus 2..less than that) and multiplying (2..9 groups of 2..9),
over eight names and eight kinds of things.

Measured on SmolLM2-135M-Instruct (the real model tools/smollm2.py builds; 32 tasks per
operation, chat template, 48 new tokens): greedy 34% of these answered right, 29% sampled at
temperature 0.7; adding 44%, taking away 31%, multiplying 22% greedy. It knows the arithmetic
more often than it says it last: its usual failure is to go on after a right answer (a second
sentence with another sum), which a reward on the last number can train away.

The held-out split (:func:`held_out_operands`) keeps every pair of operands whose sum is a
multiple of five out of training; every wording, name, thing and number still occurs in
training in other combinations.
"""

from __future__ import annotations

import random

WORD_SOURCE = "dew/word_problems"
SUFFIX = " Give the answer as a number at the end."
NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Jack", "Emma")
THINGS = ("apples", "books", "pencils", "cookies", "stickers", "marbles", "cards", "balloons")
# (operation, wording, how the reference answer says it); {n} name, {t} things, {a} {b} operands.
WORDINGS = {
    "add": (
        ("{n} has {a} {t} and gets {b} more. How many {t} does {n} have now?", "{n} has {a} + {b} = {c} {t}."),
        ("{n} had {a} {t}. A friend gave {n} {b} more. How many {t} does {n} have now?",
         "{n} has {a} + {b} = {c} {t} now."),
        ("There are {a} {t} in a box and {n} puts in {b} more. How many {t} are in the box?",
         "The box holds {a} + {b} = {c} {t}."),
    ),
    "subtract": (
        ("{n} has {a} {t} and gives away {b}. How many {t} does {n} have left?", "{n} has {a} - {b} = {c} {t} left."),
        ("{n} had {a} {t} and lost {b} of them. How many {t} does {n} have now?", "{n} has {a} - {b} = {c} {t} now."),
        ("There were {a} {t} on a table and {n} took {b}. How many {t} are on the table?",
         "The table has {a} - {b} = {c} {t}."),
    ),
    "multiply": (
        ("{n} buys {a} bags with {b} {t} in each bag. How many {t} does {n} buy in all?",
         "{n} buys {a} x {b} = {c} {t}."),
        ("There are {a} boxes with {b} {t} in each box. How many {t} are there in all?",
         "There are {a} x {b} = {c} {t}."),
        ("{n} makes {a} rows of {b} {t}. How many {t} does {n} have?", "{n} has {a} x {b} = {c} {t}."),
    ),
}
OPERATIONS = tuple(WORDINGS)


def held_out_operands(a: int, b: int) -> bool:
    """Whether an operand pair is held out: its sum is a multiple of five (about a fifth of the pairs)."""
    return (a + b) % 5 == 0


def operands(rng: random.Random, operation: str) -> tuple[int, int, int]:
    """(a, b, answer) of one problem of ``operation``."""
    if operation == "add":
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        return a, b, a + b
    if operation == "subtract":
        a = rng.randint(10, 30)
        b = rng.randint(2, a - 1)
        return a, b, a - b
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return a, b, a * b


def word_problem(rng: random.Random, held_out: bool) -> dict:
    """One problem drawn from ``rng`` on the held-out side or the training side of the split: its question (with
    :data:`SUFFIX`), a reference answer that ends with the number, the number, and its parameters."""
    operation = OPERATIONS[rng.randrange(len(OPERATIONS))]
    while True:
        a, b, answer = operands(rng, operation)
        if held_out_operands(a, b) == held_out:
            break
    question, reference = rng.choice(WORDINGS[operation])
    fields = {"n": rng.choice(NAMES), "t": rng.choice(THINGS), "a": a, "b": b, "c": answer}
    return {"question": question.format(**fields) + SUFFIX,
            "answer": reference.format(**fields) + f" The answer is {answer}.", "number": answer,
            "extra_info": {"operation": operation, "a": a, "b": b}}
