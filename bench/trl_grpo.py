"""dew-ray's GRPO against TRL's GRPOTrainer on SmolLM2-135M-Instruct's word problems: step time and time to reward.

    uv run python bench/trl_grpo.py step-time [--rounds 2] [--steps 6] [--peers float32,bf16]
    uv run python bench/trl_grpo.py time-to-reward [--minutes 30] [--bf16-peer] [--dew-run RUN_DIR]

Both runs train the same model (tools/smollm2.py builds it), on the same prompts (the built-in
``word`` family, chat prompts; the held-out split dew-ray measures on), with the same reward (the
completion's last number is the answer), samples per prompt, prompts per step, response budget,
temperature, learning rate and warm-up: the settings of ``cluster_configs/rlvr-smollm2.toml``.
TRL runs in the reference environment (``.venv-ref``, bench/peers/trl_grpo.py: GRPOTrainer on the
CPU, 2 threads, ``beta=0``, one update per generation batch); dew-ray runs ``dew-ray rlvr`` on
that recipe.

``step-time``: ``rounds`` rounds, each a TRL run of ``steps`` steps in every precision ``--peers``
names (float32, and ``bf16``: under bfloat16 autocast) then a dew-ray run of as many updates, in
fresh processes (the machine's noise hits all alike); the median seconds of a step after the
first two (compilation, warm-up), and dew-ray's over each TRL's. ``time-to-reward``: one TRL run of
``minutes`` of training (held-out measured every 5 steps) and one dew-ray run of the recipe (or
the run directory given), the held-out reward of each against its training seconds (measurements
excluded) in bench/results/trl_grpo.png, and when dew-ray first reached TRL's last held-out
reward. Tables in bench/results/trl_grpo.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from interleaved import PEER_PYTHON, RESULTS, ROOT

from dew.data.verifiable import HELD_OUT, verifiable_tasks
from dew.recipes.rlvr_recipe import EVAL_SEED_OFFSET
from dew_ray.pipelines.rlvr_config import load_config

RECIPE = ROOT / "cluster_configs" / "rlvr-smollm2.toml"
WARM = 2  # steps left out of the step-time medians (compilation, warm-up)


def prepare(folder: Path) -> dict:
    """The peer's inputs: the recipe's settings and its train and held-out prompts, as dew-ray builds them."""
    config = load_config(RECIPE)
    folder.mkdir(parents=True, exist_ok=True)
    rows = lambda tasks: "".join(json.dumps({"prompt": task.row()["prompt"], "answer": task.ground_truth}) + "\n"  # noqa: E731
                                 for task in tasks)
    (folder / "train.jsonl").write_text(rows(verifiable_tasks(config.train_tasks, seed=config.seed, families=["word"])))
    (folder / "held_out.jsonl").write_text(rows(verifiable_tasks(
        config.eval_tasks, seed=EVAL_SEED_OFFSET + config.seed, families=["word"], split=HELD_OUT)))
    settings = {"model": str(Path(config.model).expanduser()), "tasks_per_step": config.tasks_per_step,
                "samples": config.samples, "max_new_tokens": config.max_new_tokens,
                "temperature": config.temperature, "learning_rate": config.learning_rate,
                "warmup_steps": config.warmup_steps, "seed": config.seed}
    (folder / "settings.json").write_text(json.dumps(settings, indent=2))
    return settings


def trl_run(data: Path, out: Path, steps: int, bf16: bool, eval_every: int = 10 ** 9,
            seconds: float | None = None) -> list[dict]:
    out.unlink(missing_ok=True)
    command = [str(PEER_PYTHON), str(ROOT / "bench" / "peers" / "trl_grpo.py"), str(data), str(out),
               "--steps", str(steps), "--eval-every", str(eval_every)]
    command += ["--bf16"] if bf16 else []
    command += ["--seconds", str(seconds)] if seconds else []
    ran = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if ran.returncode != 0:
        raise RuntimeError(f"the TRL run failed:\n{ran.stderr[-3000:]}")
    return [json.loads(line) for line in out.read_text().splitlines()[1:]]


def dew_run(run_dir: Path, *overrides: str) -> list[dict]:
    command = [str(Path(sys.executable).parent / "dew-ray"), "rlvr", "--config", str(RECIPE),
               f"--set=run_dir={run_dir}", "--set=progress=false", *[f"--set={item}" for item in overrides]]
    ran = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if ran.returncode != 0:
        raise RuntimeError(f"the dew-ray run failed:\n{ran.stdout[-2000:]}\n{ran.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


PEER_NAMES = {"float32": "TRL GRPOTrainer, float32", "bf16": "TRL GRPOTrainer, bf16 autocast"}


def step_time(rounds: int, steps: int, peers: list[str]) -> dict:
    data = RESULTS / "trl_grpo"
    prepare(data)
    seconds: dict[str, list[float]] = {**{PEER_NAMES[peer]: [] for peer in peers}, "dew-ray rlvr": []}
    for index in range(rounds):
        for peer in peers:
            trl = trl_run(data, data / f"step-time-{peer}-{index}.jsonl", steps, peer == "bf16")
            seconds[PEER_NAMES[peer]] += [row["seconds"] for row in trl if "seconds" in row][WARM:]
        dew = dew_run(data / f"dew-step-time-{index}", f"steps={steps}", "eval_points=0", "eval_tasks=8",
                      "eval_samples=1", f"checkpoint_every={steps}")
        seconds["dew-ray rlvr"] += [row["wall"] for row in dew][WARM:]
        print(f"round {index}: " + ", ".join(f"{name} {statistics.median(values):.1f} s a step"
                                              for name, values in seconds.items()), flush=True)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    plot_step_time(seconds)
    return {"steps": steps, "rounds": rounds, "peers": peers, "seconds_per_step": medians, "all_seconds": seconds,
            "ratio_dew_over_trl": {PEER_NAMES[peer]: medians["dew-ray rlvr"] / medians[PEER_NAMES[peer]]
                                   for peer in peers}}


def plot_step_time(seconds: dict[str, list[float]]) -> None:
    """Every measured step of each side as a point, its median as a bar: bench/results/trl_grpo_step_time.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    for index, (name, values) in enumerate(seconds.items()):
        axis.bar(index, statistics.median(values), color="C%d" % index, alpha=0.6, label=name)
        axis.scatter([index] * len(values), values, color="black", s=12, zorder=3)
    axis.set_xticks(range(len(seconds)), [name.replace(", ", "\n") for name in seconds])
    axis.set_ylabel("seconds per GRPO step (8 prompts x 8 samples)")
    axis.set_title("SmolLM2-135M-Instruct GRPO step, 2-core CPU")
    figure.tight_layout()
    figure.savefig(RESULTS / "trl_grpo_step_time.png", dpi=120)


def dew_curve(run_dir: Path) -> list[tuple[float, float]]:
    """(training seconds, held-out reward) of a dew-ray run: the updates' wall time up to each held-out point."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    elapsed = {0: 0.0}
    for row in rows:
        elapsed[row["step"]] = elapsed[row["step"] - 1] + row["wall"]
    points = [json.loads(line) for line in (run_dir / "held_out.jsonl").read_text().splitlines()]
    return [(elapsed[point["step"]], point["reward"]["all"]) for point in points]


def time_to_reward(minutes: float, bf16: bool, dew_dir: Path | None) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = RESULTS / "trl_grpo"
    settings = prepare(data)
    began = time.perf_counter()
    trl = trl_run(data, data / "time-to-reward.jsonl", 10 ** 6, bf16, eval_every=5, seconds=minutes * 60)
    trl_points = [(row["train_seconds"], row["held_out"]) for row in trl if "held_out" in row]
    print(f"TRL: {len(trl) - len(trl_points)} steps, held-out {trl_points[0][1]:.3f} -> {trl_points[-1][1]:.3f} in "
          f"{trl_points[-1][0]:.0f} s of training ({time.perf_counter() - began:.0f} s in all)", flush=True)
    if dew_dir is None:
        dew_dir = data / "dew-time-to-reward"
        dew_run(dew_dir)
    dew_points = dew_curve(dew_dir)
    target = trl_points[-1][1]
    reached = next((seconds for seconds, reward in dew_points if reward >= target), None)
    figure, axis = plt.subplots(figsize=(7, 4))
    for (label, points) in ((PEER_NAMES["bf16" if bf16 else "float32"], trl_points), ("dew-ray rlvr", dew_points)):
        axis.plot([s / 60 for s, _ in points], [r for _, r in points], marker="o", label=label)
    axis.axhline(target, color="grey", linestyle=":", linewidth=1)
    axis.set_xlabel("training minutes (held-out measurements excluded)")
    axis.set_ylabel("held-out reward (mean of 4 draws at T=%g)" % settings["temperature"])
    axis.set_title("GRPO on SmolLM2-135M-Instruct, word problems, 2-core CPU")
    axis.legend()
    figure.tight_layout()
    figure.savefig(RESULTS / "trl_grpo.png", dpi=120)
    return {"trl": trl_points, "dew": dew_points, "trl_final": target, "dew_reached_trl_final_seconds": reached,
            "trl_seconds": trl_points[-1][0], "ratio": None if reached is None else reached / trl_points[-1][0],
            "peer_bf16": bf16, "dew_run": str(dew_dir)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("step-time", "time-to-reward"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--peers", default="float32", help="step-time: TRL's precisions, comma-separated, each run "
                        "every round (float32; bf16: under bfloat16 autocast)")
    parser.add_argument("--bf16-peer", action="store_true",
                        help="time-to-reward: TRL under bfloat16 autocast instead of float32")
    parser.add_argument("--dew-run", type=Path, default=None, help="a finished dew-ray run of the recipe to compare")
    args = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "trl_grpo.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    if args.mode == "step-time":
        peers = args.peers.split(",")
        if set(peers) - set(PEER_NAMES):  # an empty --peers splits to [""], refused here too
            parser.error(f"--peers takes {' and '.join(PEER_NAMES)}, comma-separated; got {args.peers!r}")
        results["step_time"] = step_time(args.rounds, args.steps, peers)
        print(json.dumps({k: v for k, v in results["step_time"].items() if k != "all_seconds"}, indent=2))
    else:
        results["time_to_reward"] = time_to_reward(args.minutes, args.bf16_peer, args.dew_run)
        print(json.dumps(results["time_to_reward"], indent=2))
    path.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
