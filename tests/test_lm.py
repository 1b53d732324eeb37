import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.data.chat import Role
from dew.objectives import LMObjective
from dew.objectives.lm import target_weights, token_log_probs

U, A, S, PAD = Role.USER, Role.ASSISTANT, Role.SYSTEM, Role.PAD


def test_role_mask_counts_exactly_the_assistant_targets():
    # Two packed conversations and one padding slot:
    #   index      0  1  2  3  4  5  6
    #   segment    1  1  1  1  2  2  0
    #   role       S  U  A  A  U  A  PAD
    # Transition i -> i+1 counts when the target is an assistant token in the same document:
    #   0->1 U no, 1->2 A yes, 2->3 A yes, 3->4 crosses documents, 4->5 A yes, 5->6 padding.
    batch = {
        "text": jnp.array([[3, 4, 5, 6, 7, 8, 0]]),
        "text_roles": jnp.array([[S, U, A, A, U, A, PAD]], jnp.int8),
        "text_segment_ids": jnp.array([[1, 1, 1, 1, 2, 2, 0]]),
        "text_positions": jnp.array([[0, 1, 2, 3, 0, 1, 0]]),
    }
    np.testing.assert_array_equal(target_weights(batch, A), [[0, 1, 1, 0, 1, 0]])
    # Without loss_role every real transition inside a document counts: 0->1, 1->2, 2->3, 4->5.
    np.testing.assert_array_equal(target_weights(batch, None), [[1, 1, 1, 0, 1, 0]])


def test_loss_is_the_mean_nll_of_counted_targets(tiny_model):
    objective = LMObjective(tiny_model, seq_len=6, loss_role=Role.ASSISTANT)
    variables = objective.init(jax.random.key(0))
    batch = {
        "text": np.array([[3, 4, 5, 6, 7, 8, 0]], np.int32),
        "text_roles": np.array([[S, U, A, A, U, A, PAD]], np.int8),
        "text_segment_ids": np.array([[1, 1, 1, 1, 2, 2, 0]], np.int32),
        "text_positions": np.array([[0, 1, 2, 3, 0, 1, 0]], np.int32),
    }
    objective.validate(batch)
    loss, metrics = objective.loss(variables, None, batch, jax.random.key(1))
    # Score each conversation on its own and pick the three counted targets by hand.
    first = jax.nn.log_softmax(tiny_model.apply(variables, jnp.array([[3, 4, 5, 6]])))[0]
    second = jax.nn.log_softmax(tiny_model.apply(variables, jnp.array([[7, 8]])))[0]
    expected = -(first[1, 5] + first[2, 6] + second[0, 8]) / 3
    np.testing.assert_allclose(loss, expected, atol=1e-6, rtol=0)
    assert float(metrics["target_tokens"]) == 3.0

    sums = objective.evaluate(variables, batch)
    summary = objective.summarize(jax.tree.map(float, sums))
    np.testing.assert_allclose(summary["loss"], expected, atol=1e-6, rtol=0)
    np.testing.assert_allclose(summary["perplexity"], np.exp(float(expected)), rtol=1e-6)


def test_token_log_probs_agree_with_log_softmax():
    logits = jax.random.normal(jax.random.key(0), (2, 3, 11))
    targets = jnp.array([[1, 2, 3], [10, 0, 5]])
    expected = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(token_log_probs(logits, targets), expected, atol=1e-6, rtol=0)


def good_batch():
    return {"text": np.zeros((2, 7), np.int32), "text_roles": np.full((2, 7), A, np.int8)}


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda b: b.pop("text"), KeyError, "needs batch field 'text'"),
        (lambda b: b.pop("text_roles"), KeyError, "loss_role=ASSISTANT needs batch field 'text_roles'"),
        (lambda b: b.update(text=np.zeros((2, 7), np.float32)), TypeError, "'text' must hold integers, got dtype float32"),
        (lambda b: b.update(text=np.zeros((2, 9), np.int32)), ValueError, "has width 9, expected seq_len \\+ 1 = 7"),
        (lambda b: b.update(text=np.zeros((14,), np.int32)), ValueError, "must be \\[rows, seq_len \\+ 1\\]"),
        (lambda b: b.update(text_roles=np.zeros((2, 6), np.int8)), ValueError, "'text_roles' must have shape \\(2, 7\\)"),
        (lambda b: b["text"].__setitem__((1, 3), 16), ValueError, "'text' row 1 holds an id outside the vocabulary"),
    ],
)
def test_bad_batches_raise_clear_errors(tiny_model, change, error, message):
    objective = LMObjective(tiny_model, seq_len=6, loss_role=Role.ASSISTANT)
    batch = good_batch()
    change(batch)
    with pytest.raises(error, match=message):
        objective.validate(batch)


def test_bad_options_raise(tiny_model):
    with pytest.raises(ValueError, match="seq_len=17 exceeds the model's max_seq_len=16"):
        LMObjective(tiny_model, seq_len=17)
    with pytest.raises(ValueError, match="loss_role must be a Role"):
        LMObjective(tiny_model, seq_len=4, loss_role=9)
    with pytest.raises(ValueError, match="ema_decay must be a finite number > 0 and <= 1 \\(None or a number in \\(0, 1\\]\\)"):
        LMObjective(tiny_model, seq_len=4, ema_decay=1.5)
    with pytest.raises(ValueError, match="outer 'params' collection"):
        LMObjective(tiny_model, seq_len=4, pretrained={"embed": 1})
