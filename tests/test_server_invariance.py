"""Server(batch_invariant=True): a request draws the same ids with the same log-probabilities, bit for bit, alone or
beside other requests of any length (its prefill never packed with theirs, its decode steps over more cache blocks
when they reach further). Without it, a prefill packed with others to a wider power of two moves the last bits."""

import numpy as np
import jax.numpy as jnp
import pytest

from dew.inference import Server, ServingTask
from dew.sampling import Sampling

A = [10, 11, 12, 13]
BESIDE = [
    [[20, 21]],  # a pack of 6 ids: the same width (8) as A's own
    [[5] * 29],  # a pack of 33 ids: width 64
    [[5] * 20, [6] * 3, [7] * 9, [8] * 60],  # wider packs, and a request reaching further blocks
]


def draw(task: ServingTask, prompts: list[list[int]], slots: int = 8) -> list:
    server = Server.from_task(task, slots=slots, capacity=128, block_size=16)
    numbers = [server.submit(prompt, 12, seed=7 if index == 0 else 100 + index) for index, prompt in enumerate(prompts)]
    finished = {}
    while len(finished) < len(numbers):
        finished.update({done.request: done for done in server.step()})
    return [finished[number] for number in numbers]


def same(a, b) -> bool:
    return a.ids == b.ids and all(np.asarray(getattr(a, name), np.float32).tobytes()
                                  == np.asarray(getattr(b, name), np.float32).tobytes()
                                  for name in ("behavior_log_probs", "old_log_probs"))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_request_draws_the_same_bits_whatever_shares_its_steps(sharp_decoder, dtype):
    model, variables = sharp_decoder
    task = ServingTask(model, variables, Sampling(eos_id=(0,), temperature=1.0), dtype=dtype, batch_invariant=True)
    alone = draw(task, [A])[0]
    for others in BESIDE:
        assert same(alone, draw(task, [A, *others])[0]), others
    assert same(alone, draw(task, [A], slots=2)[0])  # fewer rows in the step


def test_without_it_a_wider_packed_prefill_moves_the_last_bits(sharp_decoder):
    model, variables = sharp_decoder
    task = ServingTask(model, variables, Sampling(eos_id=(0,), temperature=1.0))
    alone = draw(task, [A])[0]
    assert same(alone, draw(task, [A, *BESIDE[0]])[0])  # a pack of the same width
    assert not same(alone, draw(task, [A, *BESIDE[1]])[0])  # a wider pack: the reason the option exists
