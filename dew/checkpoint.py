"""Orbax checkpoints of a TrainState together with the data stream's position.

A checkpoint directory holds one numbered step per save (``<dir>/<step>/``) with two
items: ``state``, the train state's arrays (the PRNG key stored as its raw data), and
``data``, the JSON position of the training stream. Restoring needs a template of the
same structure (arrays or ``jax.ShapeDtypeStruct``), which gives shapes, dtypes and
shardings. Trees hold plain arrays only: callers store PRNG keys as their raw data.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

# Orbax announces every save and restore at INFO; the trainer reports checkpoints itself.
logging.getLogger("absl").setLevel(logging.WARNING)


def _flatten(tree) -> tuple[dict[str, Any], Any]:
    leaves, treedef = jax.tree.flatten(tree)
    return {f"{index:05d}": leaf for index, leaf in enumerate(leaves)}, treedef


class Checkpoints:
    """Numbered checkpoints in ``directory``, keeping the newest ``keep``."""

    def __init__(self, directory: str | Path, keep: int | None = 3):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, tree, position: Any) -> None:
        if step in self._manager.all_steps():
            return
        flat, _ = _flatten(tree)
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(flat), data=ocp.args.JsonSave(position)),
        )
        self._manager.wait_until_finished()

    def restore(self, template, step: int | None = None):
        """Return ``(tree, position)`` of ``step`` (default: the newest), shaped like ``template``."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        flat, treedef = _flatten(template)
        abstract = {
            name: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding) for name, leaf in flat.items()
        }
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()),
        )
        leaves = [restored.state[name] for name in sorted(flat)]
        return jax.tree.unflatten(treedef, leaves), restored.data

    def close(self) -> None:
        self._manager.close()
