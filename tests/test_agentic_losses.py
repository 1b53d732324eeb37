"""Policy losses, group advantages, k3 KL and bypass-mode masks against verl 0.9.1.

tests/fixtures/verl_agentic.npz holds verl's own outputs and torch gradients on fixed
[6, 10] arrays (tools/parity_agentic.py; one row has no response token). Every check
holds at 1e-6 in float32; the last test prints the largest difference of each check.
Chain-level reductions get ``segments`` = the row index here, and again after packing
the six chains into two rows, where they must give verl's per-row numbers unchanged.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.losses import (
    aggregate,
    cispo_surrogate,
    group_advantages,
    gspo_surrogate,
    k3_kl,
    mismatch_metrics,
    ppo_surrogate,
    sequence_mask,
    token_band_mask,
)

FIXTURE = np.load(Path(__file__).resolve().parent / "fixtures" / "verl_agentic.npz")
META = json.loads(str(FIXTURE["meta"][0]))
X = {key.removeprefix("input."): jnp.asarray(FIXTURE[key]) for key in FIXTURE.files if key.startswith("input.")}
ROWS, WIDTH = X["response_mask"].shape
ROW_SEGMENTS = jnp.broadcast_to(jnp.arange(ROWS)[:, None], (ROWS, WIDTH))
TOLERANCE = 1e-6
DIFFERENCES: dict[str, float] = {}  # check -> largest absolute difference, printed by the last test
MODES = {"token-mean": "token-mean", "seq-mean-token-mean": "session-mean"}
SEQUENCE_CASES = [("seq_sum_k1", "sum"), ("seq_sum_k1_b", "sum"), ("seq_mean_k1", "mean"), ("seq_mean_k1_b", "mean")]


def check(name: str, got, want, tolerance: float = TOLERANCE) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    difference = float(np.max(np.abs(got - want))) if got.size else 0.0
    DIFFERENCES[name] = difference
    assert difference <= tolerance, f"{name}: largest difference {difference:.3e} > {tolerance}"


def surrogate(name: str, log_probs, x, segments, num_segments):
    case = META["cases"][name]
    low, high = case["clip_ratio_low"], case["clip_ratio_high"]
    if case["function"] == "compute_policy_loss_vanilla":
        return ppo_surrogate(log_probs, x["old_log_prob"], x["advantages"], x["response_mask"], low, high,
                             case["clip_ratio_c"])
    if case["function"] == "compute_policy_loss_gspo":
        return gspo_surrogate(log_probs, x["old_log_prob"], x["advantages"], x["response_mask"], segments,
                              num_segments, low, high)
    return cispo_surrogate(log_probs, x["old_log_prob"], x["advantages"], x["response_mask"], low, high)


def policy_loss(name: str, x, segments, num_segments):
    mode = MODES[META["cases"][name]["loss_agg_mode"]]

    def loss_of(log_probs):
        matrix, metrics = surrogate(name, log_probs, x, segments, num_segments)
        return aggregate(matrix, x["response_mask"], mode, segments, num_segments), metrics

    return jax.jit(jax.value_and_grad(loss_of, has_aux=True))(x["log_prob"])


POLICY_CASES = ["ppo_token_mean", "ppo_session_mean", "gspo", "cispo", "cispo_no_low"]


@pytest.mark.parametrize("name", POLICY_CASES)
def test_policy_loss_metrics_and_gradient_equal_verl(name):
    (loss, metrics), gradient = policy_loss(name, X, ROW_SEGMENTS, ROWS)
    check(f"{name} loss", loss, FIXTURE[f"{name}.loss"])
    check(f"{name} gradient", gradient, FIXTURE[f"{name}.grad"])
    for ours, theirs in (("clipfrac", "pg_clipfrac"), ("ppo_kl", "ppo_kl"), ("clipfrac_lower", "pg_clipfrac_lower")):
        check(f"{name} {ours}", metrics[ours], FIXTURE[f"{name}.{theirs}"])
    # The row without a response token gets no gradient.
    assert not np.asarray(gradient)[3].any()


def pack(arrays: dict, chains: list[list[int]], width: int, pad_segment: int = 99):
    """Lay each row's response tokens back to back, several chains per row; padding anywhere else."""
    mask = np.asarray(arrays["response_mask"])
    lengths = mask.sum(axis=1).astype(int)
    source = np.full((len(chains), width), -1)  # flat index into [ROWS * WIDTH], -1 on padding
    segments = np.full((len(chains), width), pad_segment)
    for row, members in enumerate(chains):
        column = 0
        for chain in members:
            source[row, column : column + lengths[chain]] = chain * WIDTH + np.arange(lengths[chain])
            segments[row, column : column + lengths[chain]] = chain
            column += lengths[chain]
    packed = {}
    for key, value in arrays.items():
        flat, pad = np.asarray(value).reshape(-1), 0.0 if key == "response_mask" else -0.5
        packed[key] = jnp.asarray(np.where(source >= 0, flat[np.maximum(source, 0)], pad), jnp.float32)
    return packed, jnp.asarray(segments), source


def unpack(values, source) -> np.ndarray:
    out = np.zeros(ROWS * WIDTH, np.float32)
    values = np.asarray(values)
    out[source[source >= 0]] = values[source >= 0]
    return out.reshape(ROWS, WIDTH)


CHAINS = [[0, 3, 5, 2], [4, 1]]  # 10 + 0 + 1 + 4 and 9 + 7 response tokens


@pytest.mark.parametrize("name", ["ppo_session_mean", "gspo"])
def test_packed_chains_give_verls_per_row_numbers(name):
    packed, segments, source = pack(X, CHAINS, width=16)
    (loss, metrics), gradient = policy_loss(name, packed, segments, ROWS)
    check(f"packed {name} loss", loss, FIXTURE[f"{name}.loss"])
    want = FIXTURE[f"{name}.grad"] * np.asarray(X["response_mask"])  # packing keeps only response tokens
    check(f"packed {name} gradient", unpack(gradient, source), want)
    check(f"packed {name} clipfrac", metrics["clipfrac"], FIXTURE[f"{name}.pg_clipfrac"])
    log_ratio = packed["log_prob"] - packed["rollout_log_prob"]
    for case, mode in SEQUENCE_CASES:
        low, high = FIXTURE[f"rs.{case}.band"]
        keep = sequence_mask(log_ratio, packed["response_mask"], segments, ROWS, float(low), float(high), mode)
        check(f"packed {case} mask", unpack(keep, source), FIXTURE[f"rs.{case}"], tolerance=0.0)


@pytest.mark.parametrize("estimator, reference", [("group", "grpo_group"), ("mean", "grpo_mean"), ("rloo", "rloo")])
def test_group_advantages_equal_verl(estimator, reference):
    advantages = jax.jit(group_advantages, static_argnames="estimator")(
        jnp.asarray(FIXTURE["advantage.scores"]), jnp.asarray(FIXTURE["advantage.index"]), estimator=estimator
    )
    check(f"advantages {estimator}", advantages, FIXTURE[f"advantage.{reference}"])


def test_group_advantages_by_hand():
    rewards, groups = jnp.array([1.0, 0.0, 0.0, 1.0, 5.0]), jnp.array([4, 4, 4, 4, 8])
    # Group 4: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735, so (1 - 0.5) / 0.57735 = 0.86603.
    # Group 8 has one member: verl keeps its reward (mean 0, std 1), 5 / (1 + 1e-6).
    np.testing.assert_allclose(group_advantages(rewards, groups, "group"),
                               [0.866024, -0.866024, -0.866024, 0.866024, 5 / (1 + 1e-6)], atol=2e-6)
    # Dr.GRPO centres only: 1 - 0.5 and 0 - 0.5.
    np.testing.assert_allclose(group_advantages(rewards, groups, "mean"), [0.5, -0.5, -0.5, 0.5, 5.0])
    # RLOO: r minus the mean of the other three: 1 - 1/3 = 2/3 and 0 - 2/3.
    np.testing.assert_allclose(group_advantages(rewards, groups, "rloo"), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 5.0],
                               atol=1e-6)


def test_k3_kl_and_gradient_equal_verl_low_var_kl():
    mask = X["response_mask"]
    check("k3 per token", k3_kl(X["log_prob"], X["ref_log_prob"]), FIXTURE["k3.kl"])
    loss, gradient = jax.value_and_grad(
        lambda log_probs: aggregate(k3_kl(log_probs, X["ref_log_prob"]), mask, "token-mean"))(X["log_prob"])
    check("k3 token-mean", loss, FIXTURE["k3.loss"])
    check("k3 gradient", gradient, FIXTURE["k3.grad"])
    # The three clamped tokens (d = +22 and -25, kld = e^5 - 6 > 10) get no gradient.
    assert float(gradient[0, 3]) == float(gradient[2, 1]) == float(gradient[1, 4]) == 0.0


def test_bypass_masks_equal_verl_rejection():
    log_ratio, mask = X["log_prob"] - X["rollout_log_prob"], X["response_mask"]
    low, high = (float(v) for v in FIXTURE["rs.token_k1.band"])
    check("token_k1 mask", token_band_mask(log_ratio, mask, low, high), FIXTURE["rs.token_k1"], tolerance=0.0)
    for case, mode in SEQUENCE_CASES:
        low, high = (float(v) for v in FIXTURE[f"rs.{case}.band"])
        keep = sequence_mask(log_ratio, mask, ROW_SEGMENTS, ROWS, low, high, mode)
        check(f"{case} mask", keep, FIXTURE[f"rs.{case}"], tolerance=0.0)
        assert 0 < float(keep.sum()) < float(mask.sum())  # the case rejects some chains and keeps others
        assert META["cases"][f"rs.{case}"]["rollout_rs_threshold"] == f"{META['cases'][f'rs.{case}']['dew_band'][0]}_" \
            f"{META['cases'][f'rs.{case}']['dew_band'][1]}"  # verl's "lo_hi" is dew's band unchanged


def test_sequence_bands_bound_k1_not_the_log_ratio():
    """The asymmetric bands (lo * hi != 1) keep other chains than a bound on log(pi / mu) would."""
    log_ratio, mask = X["log_prob"] - X["rollout_log_prob"], X["response_mask"]
    for case, mode in (("seq_sum_k1_b", "sum"), ("seq_mean_k1_b", "mean")):
        low, high = (float(v) for v in FIXTURE[f"rs.{case}.band"])
        assert abs(low * high - 1) > 0.01  # an asymmetric band: the two readings differ
        # Bounding log(pi / mu) by [log lo, log hi] is bounding k1 by [log 1/hi, log 1/lo].
        other_reading = sequence_mask(log_ratio, mask, ROW_SEGMENTS, ROWS, 1 / high, 1 / low, mode)
        assert not np.array_equal(np.asarray(other_reading), FIXTURE[f"rs.{case}"])


def test_mismatch_metrics_equal_verl():
    old, behavior, mask = X["old_log_prob"], X["rollout_log_prob"], X["response_mask"]
    capped = mismatch_metrics(old, behavior, mask, cap=float(FIXTURE["mismatch.ess_cap"]))
    for name in ("kl", "k3_kl", "ess"):
        check(f"mismatch {name}", capped[name], FIXTURE[f"mismatch.{name}"])
    check("mismatch ess uncapped", mismatch_metrics(old, behavior, mask)["ess"], FIXTURE["mismatch.ess_uncapped"])


def test_empty_batch_gives_zero_not_nan():
    # verl divides by a zero token (or sequence) count here and returns NaN; dew returns 0.
    values, mask = jnp.ones((2, 3)), jnp.zeros((2, 3))
    for mode in ("token-mean", "session-mean"):
        loss, gradient = jax.value_and_grad(lambda v, m=mode: aggregate(v, mask, m))(values)
        assert float(loss) == 0.0 and not np.asarray(gradient).any()


def test_bad_options_are_refused_with_the_value():
    values, mask = X["log_prob"], X["response_mask"]
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        aggregate(values, mask, "seq-mean-token-mean")
    with pytest.raises(ValueError, match="num_segments"):
        aggregate(values, mask, "session-mean", ROW_SEGMENTS)
    with pytest.raises(ValueError, match="'grpo'"):
        group_advantages(jnp.zeros(4), jnp.zeros(4, jnp.int32), "grpo")
    with pytest.raises(ValueError, match="dual_clip must be greater than 1"):
        ppo_surrogate(values, values, values, mask, 0.2, 0.2, 1.0)
    with pytest.raises(ValueError, match="'max'"):
        sequence_mask(values, mask, None, None, 0.5, 2.0, "max")
    with pytest.raises(ValueError, match="low=2.0, high=0.5"):
        token_band_mask(values, mask, 2.0, 0.5)


def test_report_largest_differences():
    """Runs last: prints each check's largest difference for the README's evidence table (-s)."""
    print(f"\nlargest differences against verl {META['verl']} (torch {META['torch']}):")
    for name, difference in DIFFERENCES.items():
        print(f"  {name:34s} {difference:.2e}")
    assert all(difference <= TOLERANCE for difference in DIFFERENCES.values())
