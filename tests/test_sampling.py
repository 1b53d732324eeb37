import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.sampling import Sampling, categorical, filtered_logits, sample

# probabilities 0.5, 0.3, 0.15, 0.05 (and two negligible ids)
PROBS = np.array([0.5, 0.3, 0.15, 0.05, 1e-9, 1e-9])
LOGITS = jnp.asarray(np.log(PROBS), jnp.float32)[None]


def kept(sampling, logits=LOGITS):
    filtered, _ = filtered_logits(logits, sampling)
    return set(np.flatnonzero(np.isfinite(np.asarray(filtered[0]))).tolist())


def test_filters_keep_exactly_the_right_sets():
    assert kept(Sampling(top_k=2)) == {0, 1}
    assert kept(Sampling(top_p=0.8)) == {0, 1}  # 0.5 + 0.3 reaches 0.8: the third id is not needed
    assert kept(Sampling(top_p=0.81)) == {0, 1, 2}
    assert kept(Sampling(min_p=0.2)) == {0, 1, 2}  # keep p >= 0.2 * 0.5 = 0.1
    assert kept(Sampling(top_k=3, top_p=0.7)) == {0, 1}
    assert kept(Sampling(top_k=4, min_p=0.5)) == {0, 1}  # 0.5 * 0.5 = 0.25
    # Temperature sharpens before the filters: at T=0.5 the probabilities are 0.68, 0.24, 0.06, ...
    assert kept(Sampling(temperature=0.5, top_p=0.9)) == {0, 1}


def test_top_k_support_lists_the_kept_ids():
    _, support = filtered_logits(LOGITS, Sampling(top_k=4, top_p=0.81))
    np.testing.assert_array_equal(support, [[0, 1, 2, -1]])


@pytest.mark.parametrize(
    "sampling",
    [Sampling(), Sampling(temperature=0.7), Sampling(top_k=3), Sampling(top_p=0.85), Sampling(temperature=1.3, min_p=0.2)],
)
def test_frequencies_match_the_filtered_softmax_and_log_probs_are_exact(sampling):
    rows = 20_000
    logits = jnp.tile(LOGITS, (rows, 1))
    draw = jax.jit(sample, static_argnums=2)(logits, jax.random.key(0), sampling)
    filtered, _ = filtered_logits(LOGITS, sampling)
    expected = np.asarray(jax.nn.softmax(filtered[0]))
    frequencies = np.bincount(np.asarray(draw.ids), minlength=len(PROBS)) / rows
    # standard error of a frequency near 0.5 over 20,000 draws is 0.0035; 0.015 is over 4 of them
    assert np.abs(frequencies - expected).max() < 0.015
    ids = np.asarray(draw.ids)
    with np.errstate(divide="ignore"):  # filtered-out ids have probability 0 and are never drawn
        behavior = np.log(expected)
    np.testing.assert_allclose(draw.old_log_probs, np.log(PROBS / PROBS.sum())[ids], atol=1e-6)
    np.testing.assert_allclose(draw.behavior_log_probs, behavior[ids], atol=1e-6)


def test_greedy_picks_the_argmax_with_certain_behaviour():
    logits = jax.random.normal(jax.random.key(1), (5, 50))
    draw = sample(logits, jax.random.key(2), Sampling(temperature=0))
    np.testing.assert_array_equal(draw.ids, np.argmax(logits, -1))
    np.testing.assert_array_equal(draw.behavior_log_probs, np.zeros(5))
    np.testing.assert_allclose(draw.old_log_probs, jax.nn.log_softmax(logits).max(-1), atol=1e-6)


@pytest.mark.parametrize(
    "options, message",
    [({"temperature": -1}, "temperature must be a finite number >= 0"), ({"top_k": 0}, "top_k must be a positive integer \\(or None\\)"),
     ({"top_p": 0}, "top_p must be a finite number > 0 and <= 1 \\(or None\\)"),
     ({"min_p": 1}, "min_p must be a finite number >= 0 and < 1 \\(or None\\)"),
     ({"eos_id": (1, -2)}, "eos_id must be a non-negative integer \\(None, one id")],
)
def test_bad_sampling_options_raise(options, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**options)


def test_categorical_draws_the_softmax_across_blocks_and_never_a_filtered_id():
    # 600 ids: two full blocks of 256 and a padded third; the mass sits in every block, and every third id is
    # filtered out (-inf), including the last ones before the padding
    logits = np.asarray(jax.random.normal(jax.random.key(5), (600,))) * 1.5
    logits[::3] = -np.inf
    expected = np.asarray(jax.nn.softmax(jnp.asarray(logits)))
    draws = 300_000
    ids = np.asarray(jax.jit(categorical)(jax.random.key(6), jnp.tile(jnp.asarray(logits, jnp.float32), (draws, 1))))
    assert ids.shape == (draws,) and ids.dtype == np.int32
    assert not np.isin(ids, np.arange(0, 600, 3)).any()
    frequencies = np.bincount(ids, minlength=600) / draws
    live = expected > 0
    chi2 = (((frequencies - expected)[live] ** 2) / expected[live]).sum() * draws
    # 399 degrees of freedom: mean 399, standard deviation sqrt(2 * 399) = 28; 520 is over 4 of them
    assert chi2 < 520, chi2
    # leading axes are kept, one draw per row
    assert categorical(jax.random.key(7), jnp.zeros((2, 3, 10))).shape == (2, 3)
