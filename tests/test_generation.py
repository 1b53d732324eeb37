import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.inference import TextGeneration
from dew.sampling import Sampling


@pytest.fixture(scope="module")
def policy(sharp_decoder):
    model, variables = sharp_decoder
    return TextGeneration(model).bind(variables)


def argmax_loop(policy, context, steps):
    apply = jax.jit(policy.model.apply)
    ids = list(context)
    for _ in range(steps):
        ids.append(int(jnp.argmax(apply(policy.variables, jnp.asarray([ids]))[0, -1])))
    return ids[len(context):]


def test_greedy_equals_an_argmax_loop_over_the_full_forward(policy):
    contexts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    out = policy(contexts, 6, jax.random.key(0), Sampling(temperature=0))
    for row, context in enumerate(contexts):
        assert out.response(row) == argmax_loop(policy, context, 6)
    np.testing.assert_array_equal(out.behavior_log_probs, 0.0)
    assert not np.asarray(out.eos).any() and (np.asarray(out.lengths) == 6).all()


def test_a_row_samples_the_same_alone_as_in_a_ragged_batch(policy):
    sampling = Sampling(temperature=1.0, top_k=8)
    contexts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 12, 13], [11]]
    for context in contexts:
        others = [c for c in contexts if c is not context]
        together = policy([context] + others, 8, jax.random.key(3), sampling)  # widths bucket to 8 or 16
        alone = policy([context], 8, jax.random.key(3), sampling)
        assert together.response(0) == alone.response(0)
        np.testing.assert_allclose(together.old_log_probs[0], alone.old_log_probs[0], atol=1e-5)
        np.testing.assert_allclose(together.behavior_log_probs[0], alone.behavior_log_probs[0], atol=1e-5)


def test_eos_ends_a_row_and_nothing_follows(policy):
    greedy = policy([[1, 2, 3]], 6, jax.random.key(0), Sampling(temperature=0))
    third = greedy.response(0)[2]
    out = policy([[1, 2, 3]], 6, jax.random.key(0), Sampling(temperature=0, eos_id=(31, third)))
    assert out.response(0) == greedy.response(0)[:3] and bool(out.eos[0])
    np.testing.assert_array_equal(out.ids[0, 3:], 0)
    np.testing.assert_array_equal(out.old_log_probs[0, 3:], 0.0)


def test_log_probs_are_the_raw_and_filtered_likelihoods(policy):
    sampling = Sampling(temperature=0.8, top_k=5)
    out = policy([[1, 2, 3]], 4, jax.random.key(1), sampling)
    ids = [1, 2, 3] + out.response(0)
    logits = jax.jit(policy.model.apply)(policy.variables, jnp.asarray([ids]))[0, 2:-1]
    raw = jax.nn.log_softmax(logits)
    scaled = logits / 0.8
    threshold = jnp.sort(scaled, axis=-1)[:, -5][:, None]
    behavior = jax.nn.log_softmax(jnp.where(scaled >= threshold, scaled, -jnp.inf))
    picked = np.asarray(ids[3:])
    np.testing.assert_allclose(out.old_log_probs[0], raw[np.arange(4), picked], atol=1e-5)
    np.testing.assert_allclose(out.behavior_log_probs[0], behavior[np.arange(4), picked], atol=1e-5)


def test_bad_requests_raise(policy):
    with pytest.raises(ValueError, match="context 1 is empty"):
        policy([[1], []], 4, jax.random.key(0), Sampling())
    with pytest.raises(ValueError, match="context 0 holds an id outside the vocabulary \\[0, 32\\)"):
        policy([[1, 40]], 4, jax.random.key(0), Sampling())
    with pytest.raises(ValueError, match="has no variables"):
        TextGeneration(policy.model)([[1]], 4, jax.random.key(0), Sampling())
