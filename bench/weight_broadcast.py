"""Weight broadcast through Ray's object store against a plain memory copy of the same bytes.

For trees of 10 MB, 100 MB and 1 GB (float32 leaves of 1M..64M elements, like a model's
layers), ``WeightBroadcast.load`` publishes to 1, 2 and 4 receiver actors on this node:
one host copy and one ``ray.put`` of the tree, then every actor copies each leaf into
memory of its own (as a rollout server copies new weights into its served arrays) and
answers. The baseline is ``np.copyto`` of the same bytes in this process, once per
receiver, into freshly allocated arrays as the receivers' copies are (so both pay for
first touching new pages). Medians of ``--rounds`` rounds after a warm-up.

    uv run python bench/weight_broadcast.py [--rounds 3]

Prints a table and writes bench/results/weight_broadcast.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import ray

from dew_ray.weight_broadcast import WeightBroadcast

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"10 MB": 10 << 20, "100 MB": 100 << 20, "1 GB": 1 << 30}
ACTORS = (1, 2, 4)


@ray.remote(num_cpus=0.25)
class Receiver:
    """Keeps a private copy of every tree it is sent, as a server keeps its served weights."""

    def __init__(self):
        self.held = None
        self.version = -1

    def load(self, tree, version):
        self.held = {name: np.array(leaf, copy=True) for name, leaf in tree.items()}
        self.version = version
        return version


def make_tree(total: int) -> dict[str, np.ndarray]:
    leaf = min(total, 64 << 20) // 4  # float32 elements per leaf: at most 64 MB
    count = max(1, total // (leaf * 4))
    rng = np.random.default_rng(0)
    return {f"layer_{i}": rng.standard_normal(leaf, dtype=np.float32) for i in range(count)}


def copy_seconds(tree, receivers: int) -> float:
    targets = [{name: np.empty_like(leaf) for name, leaf in tree.items()} for _ in range(receivers)]
    start = time.perf_counter()
    for target in targets:
        for name, leaf in tree.items():
            np.copyto(target[name], leaf)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False,
             object_store_memory=3 << 30)
    results = {}
    try:
        for label, total in SIZES.items():
            tree = make_tree(total)
            nbytes = sum(leaf.nbytes for leaf in tree.values())
            for count in ACTORS:
                actors = [Receiver.remote() for _ in range(count)]
                broadcast = WeightBroadcast(actors, [f"receiver {i}" for i in range(count)])
                broadcast.load(tree, 0)  # warm-up: actors started, first transfer
                pushes, copies = [], []
                for version in range(1, args.rounds + 1):
                    start = time.perf_counter()
                    broadcast.load(tree, version)
                    pushes.append(time.perf_counter() - start)
                    copies.append(copy_seconds(tree, count))
                push, copy = statistics.median(pushes), statistics.median(copies)
                results[f"{label}/{count}"] = {"bytes": nbytes, "actors": count, "broadcast_s": push, "copy_s": copy,
                                               "ratio": push / copy, "broadcast_gbps": nbytes * count / push / 1e9}
                row = results[f"{label}/{count}"]
                print(f"{label:>7} to {count} actor(s): broadcast {push * 1e3:8.1f} ms, copy {copy * 1e3:8.1f} ms, "
                      f"ratio {row['ratio']:.2f}x", flush=True)
                for actor in actors:
                    ray.kill(actor)
            del tree
    finally:
        ray.shutdown()

    print(f"\nWeight broadcast (one ray.put, every actor copies the tree) vs np.copyto of the same bytes, "
          f"medians of {args.rounds}, {os.cpu_count()} CPU cores")
    print(f"{'tree':>7} {'actors':>6} {'broadcast ms':>13} {'copy ms':>9} {'ratio':>7} {'GB/s delivered':>15}")
    for row_key, row in results.items():
        label = row_key.split("/")[0]
        print(f"{label:>7} {row['actors']:>6} {row['broadcast_s'] * 1e3:>13.1f} {row['copy_s'] * 1e3:>9.1f} "
              f"{row['ratio']:>6.2f}x {row['broadcast_gbps']:>15.2f}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "weight_broadcast.json").write_text(json.dumps(results, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 3.5))
    for label in SIZES:
        axis.plot(ACTORS, [results[f"{label}/{c}"]["ratio"] for c in ACTORS], marker="o", label=label)
    axis.set_xticks(ACTORS)
    axis.set_xlabel("receiver actors")
    axis.set_ylabel("broadcast time / memory copy time")
    axis.set_title("dew_ray WeightBroadcast vs np.copyto")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "weight_broadcast.png", dpi=120)
    print(f"wrote {out / 'weight_broadcast.json'} and {out / 'weight_broadcast.png'}")


if __name__ == "__main__":
    main()
