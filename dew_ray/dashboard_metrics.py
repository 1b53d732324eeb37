"""Training series for the Ray dashboard: ``ray.util.metrics`` gauges and counters of a pipeline run.

``PipelineMetrics(run)`` registers, tagged with the run's name:

- ``dew_reward_mean`` (gauge): mean reward of the last update's admitted rollouts;
- ``dew_update_step`` (gauge): optimizer updates committed;
- ``dew_policy_version`` and ``dew_policy_lag`` (gauges): the version the trainer trained
  and how many updates behind it the oldest admitted call was sampled;
- ``dew_rollout_tokens_per_second`` (gauge): sampled tokens admitted per second of wall time;
- ``dew_trainer_wait_share`` (gauge): the share of wall time the trainer waited on rollouts;
- ``dew_episode_turns``, ``dew_episode_truncated_share`` and ``dew_episode_tool_errors``
  (gauges, runs with an environment): model calls per episode, the share a limit
  truncated, and tool errors per episode (from environments that report them);
- ``dew_sandbox_verdicts_total`` (counter, tag ``verdict``): sandboxed programs by Verdict.

Ray's metrics agent exports them on every node in Prometheus format (with the ``ray_``
prefix) at the node's metrics export port; the dashboard's Metrics view shows them once
Prometheus and Grafana are set up for the cluster (see docs/tutorials/ray-cluster.md).
"""

from __future__ import annotations

from collections.abc import Mapping

from ray.util import metrics

_GAUGES = {
    "reward_mean": "mean reward of the last update's admitted rollouts",
    "update_step": "optimizer updates committed",
    "policy_version": "the policy version the trainer trained",
    "policy_lag": "updates between the trained version and the oldest admitted call's",
    "rollout_tokens_per_second": "sampled tokens admitted per second of wall time",
    "trainer_wait_share": "share of wall time the trainer spent waiting for rollouts",
    "episode_turns": "model calls per episode of the last update's admitted rollouts (environment runs)",
    "episode_truncated_share": "share of the last update's episodes that a limit truncated (environment runs)",
    "episode_tool_errors": "tool errors per episode of the last update (environments that report them)",
}


class PipelineMetrics:
    """The dashboard series of one run (see the module docstring)."""

    def __init__(self, run: str):
        self.tags = {"run": run}
        self.gauges = {name: metrics.Gauge(f"dew_{name}", description=text, tag_keys=("run",))
                       for name, text in _GAUGES.items()}
        self.verdicts = metrics.Counter("dew_sandbox_verdicts_total", description="sandboxed programs by verdict",
                                        tag_keys=("run", "verdict"))

    def record(self, values: Mapping[str, float | None], verdicts: Mapping[str, int] | None = None) -> None:
        """Set the gauges named in ``values`` (None leaves a gauge as it was) and add verdict counts."""
        for name, value in values.items():
            if name not in self.gauges:
                raise KeyError(f"no dashboard series {name!r}; the series are {sorted(self.gauges)}")
            if value is not None:
                self.gauges[name].set(float(value), tags=self.tags)
        for verdict, count in (verdicts or {}).items():
            if count:
                self.verdicts.inc(count, tags={**self.tags, "verdict": verdict})
