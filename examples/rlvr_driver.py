"""Driving the Ray RLVR pipeline step by step, as from a notebook.

    uv run python examples/rlvr_driver.py [--steps 12] [--run-dir runs/driver]

Starts a local Ray cluster (or attaches to RAY_ADDRESS), runs the pipeline a few
updates at a time and prints what each update did, then finishes the run (held-out
reward, safetensors export, plot) and stops every actor it started.
"""

from __future__ import annotations

import argparse

from dew_ray.pipelines.rlvr import RLVRPipeline, load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--run-dir", default="runs/driver")
    args = parser.parse_args()
    config = load_config(None, [f"steps={args.steps}", f"run_dir={args.run_dir}", "progress=false"])
    with RLVRPipeline(config) as pipeline:
        started = pipeline.start()
        print(f"started at update {started['step']} (restored: {started['restored']}); "
              f"held-out reward before: {started['reward_before']['all']:.3f}")
        while pipeline.step_count < config.steps:
            for row in pipeline.step(4):
                print(f"update {row['step']:3d}: reward {row['rollout/reward/mean']:.3f}, lag {row['scheduler/lag']}, "
                      f"waited {row['waited']:.2f} s of {row['wall']:.2f} s")
        summary = pipeline.finish()
    print(f"held-out reward {summary['reward_before']['all']:.3f} -> {summary['reward_after']['all']:.3f}; "
          f"wait share {summary['wait_share']:.1%}; run directory {summary['run_dir']}")


if __name__ == "__main__":
    main()
