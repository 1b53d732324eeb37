"""Built-in verifiable tasks for RLVR: arithmetic checked by MathReward, small programs run by CodeReward.

Demos, tests and benches need tasks whose completions a program can check, a
tokenizer and a warm-start corpus, without downloading anything. This module makes
them procedurally from a seed:

- ``math`` (data source ``dew/arithmetic``): "What is forty plus seven?" answered
  `` \\boxed{47}``: a multiple of ten 10..90 plus a digit 0..9, both as words (90
  pairs). The ground truth is the answer as an integer string, which
  :class:`~dew.sandbox.MathReward` compares with the last ``\\boxed{}`` of a completion.
- ``code`` (data source ``dew/expression_code``): "Given a, b: print their product
  plus three." answered with a fenced one-line python program, ``print(a*b+3)``.
  The ground truth is a JSON list of one ``{"stdin", "stdout"}`` case: three lines
  ``a b`` in, the three values out. :class:`~dew.sandbox.CodeReward` checks it in a
  :class:`~dew.sandbox.SandboxFleet`: the block is written to ``main.py`` and run by
  :data:`CODE_HARNESS`, which executes it once per input line with ``a`` and ``b`` set
  (the harness keeps the program to one line, short enough for a tiny decoder). A
  completion scores 1.0 when all three values are right, else 0.0. One sandboxed run
  per completion rather than one per input: starting a sandbox and Python is most of
  a completion's scoring time, and scoring is the slowest part of a batch when the
  policy writes many distinct programs. There are 125 specifications (five aggregates
  of a and b, each bare or plus, minus or times a number 2..9).
- ``word`` (data source ``dew/word_problems``): one-step word problems asked as a chat
  message, for a real chat model (:mod:`dew.data.word_problems`): "Mia has 12 stickers and
  gets 7 more. How many stickers does Mia have now? Give the answer as a number at the end."
  The ground truth is the answer as an integer string, which
  :class:`~dew.sandbox.LastNumberReward` compares with the completion's last number.

In the ``math`` and ``code`` families numbers in prompts are words ("seven", not "7"): in a short warm start a tiny decoder
learns to read a word of several characters long before it learns to copy a lone
digit, and without reading the prompt its reward stays near zero.

Each family's table is split in two (``split``): the held-out pairs and specifications
(:func:`held_out_sum`, :func:`held_out_specification`, about a fifth of each table) never
occur among the training tasks, though every word of them does, in other combinations.
Both families answer by a rule (a digit per number word; the symbols of the
aggregate, the modifier and the number), so the held-out split measures whether a
policy learned the rule, not whether it remembers answers: :func:`shared_prompts` of a
held-out draw against any training draw is 0. :func:`teacher_errors` gives a warm start
something to unlearn: a share of the demonstrations carry one habitual slip, a number one
higher than the right one, which a verifier's reward can train away on every task at once.

A :class:`VerifiableTask` gives its verl-style row (``data_source``, ``prompt``,
``reward_model.ground_truth``, ``extra_info``; :class:`~dew.data.Prompts` reads it with
:func:`task_tokenizer`) and its demonstration (prompt and the reference completion)
for supervised warm starts (:func:`demonstration_dataset`). The rewards that check them,
routed by ``data_source``, are the recipe's: :func:`dew.recipes.reward_routing.verifiable_reward`.

The tokenizer is character-level over printable ASCII and newline (98 ids): the task
alphabet is small and fixed, so nothing needs training. It is not meant for other text.
"""

from __future__ import annotations

import dataclasses
import json
import random
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dew.data.chat import Role
from dew.data.dataset import Dataset
from dew.data.loading import Loading, row_stream
from dew.data.document_packing import pack_documents
from dew.data.word_problems import WORD_SOURCE, word_problem
from dew.validation import distinct, positive_int


MATH_SOURCE = "dew/arithmetic"
CODE_SOURCE = "dew/expression_code"
FAMILIES = {"math": MATH_SOURCE, "code": CODE_SOURCE, "word": WORD_SOURCE}

EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<|unk|>"
# Printable ASCII less the whitespace a task never writes; newline stays for code.
ALPHABET = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")

# What a code task's words mean: (phrase, expression of a and b, whether it needs
# parentheses before a "*k").
_AGGREGATES = (
    ("their sum", "a+b", True),
    ("their difference a-b", "a-b", True),
    ("their product", "a*b", False),
    ("the larger", "max(a,b)", False),
    ("the smaller", "min(a,b)", False),
)
_MODIFIERS = (("plus", "+"), ("minus", "-"), ("times", "*"))
# Numbers in prompts are words (see the module docstring).
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
TENS_WORDS = ("", "ten", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
TRAIN, HELD_OUT = "train", "held_out"
SPLITS = (TRAIN, HELD_OUT)
CODE_INPUTS = 3  # input lines of a code task's one test case
# How a code completion runs: its block is main.py, executed once per stdin line "a b" with a
# and b set. The programs need no installed package: -S skips site (about a third of Python's
# start-up) and -I ignores the user site and PYTHON* variables.
CODE_HARNESS = ("python3", "-S", "-I", "-c",
                "import sys;source=open('main.py').read()\n"
                "for line in sys.stdin: a,b=map(int,line.split());exec(source)")


@dataclasses.dataclass(frozen=True)
class VerifiableTask:
    """One generated task.

    family: "math", "code" or "word"; data_source: the reward route (``MATH_SOURCE``,
    ``CODE_SOURCE`` or ``WORD_SOURCE``); prompt: the text the model continues (or, with
    ``chat``, the user message it answers); answer: a reference completion that scores 1.0;
    ground_truth: what the family's reward reads; extra_info: the task's parameters
    (operands, operator, specification, index); chat: the row's prompt is a list of chat
    messages, rendered by the model's chat template.
    """

    family: str
    data_source: str
    prompt: str
    answer: str
    ground_truth: str
    extra_info: Mapping[str, Any]
    chat: bool = False

    def row(self) -> dict[str, Any]:
        """The task as a verl-style row, as :class:`~dew.data.Prompts` reads it."""
        return {
            "data_source": self.data_source,
            "prompt": [{"role": "user", "content": self.prompt}] if self.chat else self.prompt,
            "ability": self.family,
            "reward_model": {"style": "rule", "ground_truth": self.ground_truth},
            "extra_info": dict(self.extra_info),
        }


def held_out_sum(tens: int, units: int) -> bool:
    """Whether the math pair (``tens`` x 10, ``units``) is held out: (tens + units) % 5 == 0, 18 of the 90 pairs.

    Every tens word and every units word still occurs in training, with other partners.
    """
    return (tens + units) % 5 == 0


def math_task(rng: random.Random, index: int = 0, split: str = TRAIN) -> VerifiableTask:
    """An arithmetic task of ``split`` drawn from ``rng``: a multiple of ten plus a digit, as words.

    "What is forty plus seven?" answered `` \\boxed{47}``: tens 10..90 and units 0..9 (90
    pairs). The answer follows a rule a tiny decoder can learn, the tens digit from the
    first word and the units digit from the second, so pairs it never trained on
    (:func:`held_out_sum`) measure whether it learned the rule rather than the answers.
    """
    while True:
        tens, units = rng.randint(1, 9), rng.randint(0, 9)
        if held_out_sum(tens, units) == (split == HELD_OUT):
            break
    total = 10 * tens + units
    return VerifiableTask(
        family="math", data_source=MATH_SOURCE, prompt=f"What is {TENS_WORDS[tens]} plus {NUMBER_WORDS[units]}?",
        answer=f" \\boxed{{{total}}}", ground_truth=str(total),
        extra_info={"index": index, "a": 10 * tens, "b": units, "op": "+", "split": split},
    )


def code_specification(aggregate: int, modifier: int | None, k: int) -> tuple[str, str]:
    """(words, python expression) of one code specification; ``modifier`` None for a bare aggregate."""
    words, expression, grouped = _AGGREGATES[aggregate]
    if modifier is None:
        return words, expression
    name, symbol = _MODIFIERS[modifier]
    if symbol == "*" and grouped:
        expression = f"({expression})"
    return f"{words} {name} {NUMBER_WORDS[k]}", f"{expression}{symbol}{k}"


def held_out_specification(aggregate: int, modifier: int | None, k: int) -> bool:
    """Whether a code specification is held out: a modified one with (aggregate + modifier + k) % 5 == 0.

    24 of the 125 specifications; every aggregate, modifier and number still occurs in
    training in other combinations.
    """
    return modifier is not None and (aggregate + modifier + k) % 5 == 0


def code_task(rng: random.Random, index: int = 0, split: str = TRAIN) -> VerifiableTask:
    """A code task of ``split`` drawn from ``rng``: a one-line program printing an expression of ``a`` and ``b``.

    Its ground truth is one case of :data:`CODE_INPUTS` input lines (module docstring);
    the held-out specifications are :func:`held_out_specification`'s.
    """
    while True:
        aggregate = rng.randrange(len(_AGGREGATES))
        modifier = None if rng.random() < 0.2 else rng.randrange(len(_MODIFIERS))
        k = rng.randint(2, 9)
        if held_out_specification(aggregate, modifier, k) == (split == HELD_OUT):
            break
    words, expression = code_specification(aggregate, modifier, k)
    stdin, stdout = [], []
    for _ in range(CODE_INPUTS):
        a, b = rng.randint(-20, 50), rng.randint(-20, 50)
        value = eval(expression, {"max": max, "min": min}, {"a": a, "b": b})  # our own expression, not input
        stdin.append(f"{a} {b}\n")
        stdout.append(f"{value}\n")
    cases = [{"stdin": "".join(stdin), "stdout": "".join(stdout)}]
    return VerifiableTask(
        family="code", data_source=CODE_SOURCE, prompt=f"Given a, b: print {words}.\n",
        answer=f"```python\nprint({expression})\n```", ground_truth=json.dumps(cases),
        extra_info={"index": index, "expression": expression, "split": split},
    )


def word_task(rng: random.Random, index: int = 0, split: str = TRAIN) -> VerifiableTask:
    """A one-step word problem of ``split`` drawn from ``rng``, asked as a chat message (:mod:`dew.data.word_problems`)."""
    problem = word_problem(rng, held_out=split == HELD_OUT)
    return VerifiableTask(
        family="word", data_source=WORD_SOURCE, prompt=problem["question"], answer=problem["answer"],
        ground_truth=str(problem["number"]), extra_info={"index": index, **problem["extra_info"], "split": split},
        chat=True,
    )


_MAKERS: dict[str, Callable[[random.Random, int, str], VerifiableTask]] = {"math": math_task, "code": code_task,
                                                                          "word": word_task}


def verifiable_tasks(count: int, seed: int = 0, families: Sequence[str] = ("math", "code"),
                     split: str = TRAIN) -> list[VerifiableTask]:
    """``count`` tasks of ``split`` ("train" or "held_out"), the same for the same seed, cycling through ``families``.

    Cycling (rather than drawing the family) keeps every window of ``len(families)``
    consecutive tasks balanced, so batches read in order have a fixed mix. The two
    splits share no prompt, whatever their seeds.
    """
    positive_int("count", count)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if isinstance(families, str) or not families:
        raise ValueError(f"families must be a non-empty sequence of names from {sorted(_MAKERS)}, got {families!r}")
    distinct("families", families)
    unknown = [f for f in families if f not in _MAKERS]
    if unknown:
        raise ValueError(f"unknown task families {unknown}; the built-in ones are {sorted(_MAKERS)}")
    rng = random.Random(seed)
    return [_MAKERS[families[i % len(families)]](rng, i, split) for i in range(count)]


def teacher_errors(tasks: Sequence[VerifiableTask], share: float, seed: int = 0) -> list[VerifiableTask]:
    """The tasks with the reference answers of a fallible teacher: ``share`` of them carry one off-by-one slip.

    The teacher's slip is a habit, the same on every task: it writes a number one higher
    than the right one. A picked math answer is the sum plus one (``\\boxed{48}`` for
    forty plus seven); a picked code answer with a number has it one higher (``print(a*b+4)``
    for "their product plus three"); a bare aggregate, which has no number, becomes another
    aggregate. Only ``answer`` changes (the ground truth stays right). A warm start on these
    demonstrations learns the rule and the habit with it, and samples the habit at
    temperature 1. Because the habit is one behaviour shared by every task rather than a
    different wrong digit each time, a verifier's reward that trains it away on the training
    tasks trains it away on the held-out ones too. Deterministic in ``seed``.
    """
    if not 0 <= share < 1:
        raise ValueError(f"share must be in [0, 1), got {share!r}")
    rng = random.Random(seed)
    return [_slip(task, rng) if rng.random() < share else task for task in tasks]


def _slip(task: VerifiableTask, rng: random.Random) -> VerifiableTask:
    if task.family == "math":
        return dataclasses.replace(task, answer=f" \\boxed{{{int(task.ground_truth) + 1}}}")
    expression = task.extra_info["expression"]
    if expression[-1].isdigit():  # a modified specification ends with its number, 2..9 (9 becomes 10)
        wrong = f"{expression[:-1]}{int(expression[-1]) + 1}"
    else:
        wrong = rng.choice([e for _, e, _ in _AGGREGATES if e != expression])
    return dataclasses.replace(task, answer=f"```python\nprint({wrong})\n```")


def shared_prompts(tasks: Sequence[VerifiableTask], train: Sequence[VerifiableTask]) -> int:
    """How many of ``tasks`` ask a prompt that also occurs in ``train`` (the tables are small: module docstring)."""
    seen = {task.prompt for task in train}
    return sum(task.prompt in seen for task in tasks)


def task_rows(tasks: Sequence[VerifiableTask]) -> list[dict[str, Any]]:
    """The tasks as verl-style rows (:meth:`VerifiableTask.row`)."""
    return [task.row() for task in tasks]


# ----- tokenizer --------------------------------------------------------------------------------


CHAT_TEMPLATE = (  # every character is in ALPHABET: a rendered conversation has no unknown ids of its own
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def task_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` over :data:`ALPHABET`.

    Id 0 is ``<|endoftext|>`` (end of sequence, beginning of sequence and padding), id
    1 is ``<|unk|>`` for any character outside the alphabet, and ids 2.. are the
    characters in ``ALPHABET`` order (98 ids in all). Decoding concatenates characters.
    Its chat template (:data:`CHAT_TEMPLATE`) writes each message as ``role: content``
    on its own line, so prompts given as messages (verl's parquet layout) render too.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {EOS_TOKEN: 0, UNK_TOKEN: 1, **{char: 2 + i for i, char in enumerate(ALPHABET)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character alone
    tokenizer.decoder = decoders.Fuse()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


# ----- warm start -------------------------------------------------------------------------------


def demonstration_documents(tokenizer, tasks: Sequence[VerifiableTask]) -> tuple[list[list[int]], list[list[int]]]:
    """(ids, roles) per task: the prompt as USER, the reference answer and EOS as ASSISTANT."""
    documents, roles = [], []
    for task in tasks:
        prompt = tokenizer.encode(task.prompt, add_special_tokens=False)
        answer = tokenizer.encode(task.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        documents.append(prompt + answer)
        roles.append([int(Role.USER)] * len(prompt) + [int(Role.ASSISTANT)] * len(answer))
    return documents, roles


def demonstration_dataset(tokenizer, tasks: Sequence[VerifiableTask], seq_len: int, batch: int,
                          seed: int = 0, documents: Callable = demonstration_documents) -> Dataset:
    """The tasks' demonstrations packed into ``[batch, seq_len + 1]`` rows for an SFT warm start.

    Rows carry ``text``, ``text_segment_ids``, ``text_positions`` and ``text_roles``;
    train with ``LMObjective(..., loss_role=Role.ASSISTANT)`` to learn the answers
    only. The stream reshuffles rows every epoch from ``seed``; there is no validation
    split (measure the reward instead). ``documents(tokenizer, tasks)`` writes the (ids, roles)
    of each demonstration (default :func:`demonstration_documents`; a tool environment writes
    its episodes).
    """
    positive_int("batch", batch)
    documents, roles = documents(tokenizer, tasks)
    longest = max(len(d) for d in documents)
    if longest > seq_len + 1:
        raise ValueError(f"a demonstration has {longest} ids; seq_len + 1 = {seq_len + 1} cannot hold it")
    # Longest first, so next-fit packing fills rows with the short (math) documents after the long ones.
    order = sorted(range(len(documents)), key=lambda i: -len(documents[i]))
    rows = pack_documents([documents[i] for i in order], seq_len + 1, pad_id=tokenizer.pad_token_id,
                          roles=[roles[i] for i in order])
    train = row_stream(rows, batch, Loading(seed=seed), "demonstration_dataset")
    return Dataset(train=train, val=None, records=len(rows["text"]), batch=batch)

