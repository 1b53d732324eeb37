"""Behaviour-policy corrections against verl 0.9.1: token TIS, IcePop and the PPO loss they reweight.

tests/fixtures/verl_behavior.npz holds verl's compute_rollout_correction_weights (token
level, threshold 2.0 and "0.5_2.0") and compute_policy_loss_vanilla with those weights as
rollout_is_weights, loss and torch gradient (tools/parity_behavior.py). Every check holds
at 1e-6 in float32; the last test prints the largest difference of each check.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.losses import (
    aggregate,
    icepop_weights,
    ppo_surrogate,
    token_tis_weights,
)

FIXTURE = np.load(Path(__file__).resolve().parent / "fixtures" / "verl_behavior.npz")
META = json.loads(str(FIXTURE["meta"][0]))
X = {key.removeprefix("input."): jnp.asarray(FIXTURE[key]) for key in FIXTURE.files if key.startswith("input.")}
TOLERANCE = 1e-6
DIFFERENCES: dict[str, float] = {}  # check -> largest absolute difference, printed by the last test


def check(name: str, got, want) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    difference = float(np.max(np.abs(got - want)))
    DIFFERENCES[name] = difference
    assert difference <= TOLERANCE, f"{name}: largest difference {difference:.3e} > {TOLERANCE}"


def weights(name: str, mask=None) -> jax.Array:
    threshold = [float(v) for v in FIXTURE[f"{name}.threshold"]]
    if name == "tis":
        return token_tis_weights(X["old_log_prob"], X["rollout_log_prob"], threshold[0], mask=mask)
    return icepop_weights(X["old_log_prob"], X["rollout_log_prob"], *threshold, mask=mask)


@pytest.mark.parametrize("name", ["tis", "icepop"])
def test_weights_equal_verl_and_carry_no_gradient(name):
    mask = X["response_mask"]
    check(f"{name} weights", weights(name, mask), FIXTURE[f"{name}.weights"])
    # Without a mask only padding differs (verl zeroes it).
    check(f"{name} weights, mask applied after", weights(name) * mask, FIXTURE[f"{name}.weights"])
    gradient = jax.grad(lambda old: (token_tis_weights(old, X["rollout_log_prob"], 2.0) if name == "tis" else
                                     icepop_weights(old, X["rollout_log_prob"], 0.5, 2.0)).sum())(X["old_log_prob"])
    assert not np.asarray(gradient).any()


def test_weights_by_hand():
    old, behavior = jnp.array([[-1.0, -1.0, -1.0, -1.0]]), jnp.array([[-1.0, -2.0, -0.2, -31.0]])
    # pi/mu = e^0 = 1, e^1 = 2.718, e^-0.8 = 0.449 and e^30 clamped to e^20, so TIS caps the second
    # and the last at 2, and the IcePop band [0.5, 2] keeps only the first.
    np.testing.assert_allclose(token_tis_weights(old, behavior, 2.0), [[1.0, 2.0, np.exp(-0.8), 2.0]], rtol=1e-6)
    np.testing.assert_allclose(icepop_weights(old, behavior, 0.5, 2.0), [[1.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize("name", ["tis", "icepop"])
@pytest.mark.parametrize("mode, label", [("token-mean", "token_mean"), ("session-mean", "session_mean")])
def test_reweighted_ppo_loss_and_gradient_equal_verl(name, mode, label):
    mask, correction = X["response_mask"], weights(name, X["response_mask"])

    def loss_of(log_probs):
        matrix, _ = ppo_surrogate(log_probs, X["old_log_prob"], X["advantages"], mask, 0.2, 0.28, 3.0)
        return aggregate(matrix * correction, mask, mode)

    loss, gradient = jax.jit(jax.value_and_grad(loss_of))(X["log_prob"])
    check(f"{name} ppo {mode} loss", loss, FIXTURE[f"{name}.ppo_{label}.loss"])
    check(f"{name} ppo {mode} gradient", gradient, FIXTURE[f"{name}.ppo_{label}.grad"])


def test_bad_caps_and_bands_are_refused_with_the_value():
    old = X["old_log_prob"]
    with pytest.raises(ValueError, match="cap must be positive, got 0"):
        token_tis_weights(old, old, 0.0)
    with pytest.raises(ValueError, match="low=2.0, high=0.5"):
        icepop_weights(old, old, 2.0, 0.5)
    with pytest.raises(ValueError, match="low=0.0"):
        icepop_weights(old, old, 0.0, 2.0)


def test_report_largest_differences():
    """Runs last: prints each check's largest difference for the README's evidence table (-s)."""
    print(f"\nlargest differences against verl {META['verl']} (torch {META['torch']}):")
    for name, difference in DIFFERENCES.items():
        print(f"  {name:36s} {difference:.2e}")
    assert all(difference <= TOLERANCE for difference in DIFFERENCES.values())
