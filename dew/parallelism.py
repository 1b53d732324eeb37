"""How training spreads over devices: a named mesh, and a rule table that shards the state over it.

``Parallelism(fsdp=4, tensor=2)`` lays the devices out as a mesh with three named axes:

- ``data``: plain data parallelism; each group of devices along it holds a whole copy of
  the state and its own rows of the batch (the default puts every device here, which is
  replicated data-parallel training);
- ``fsdp``: fully sharded data parallelism (ZeRO-3): parameters, gradients and optimizer
  state are split along it, and so are the batch rows; XLA gathers a layer's weights for
  its products and reduce-scatters its gradients;
- ``tensor``: tensor (Megatron) parallelism: the attention and MLP projections are split
  by column (q/k/v, gate/up) and by row (o, down), so a product's output stays split over
  ``tensor`` until the row-split product sums it; the batch is not split along it.

``data x fsdp x tensor`` must be the device count (``data=None`` takes what is left). Batch
rows are split over ``data x fsdp``. Which axes a leaf is split along comes from a rule
table (:data:`RULES`): a path pattern over the leaf's place in the tree (``.../q_proj/kernel``)
gives one logical axis name per dimension (``embed``, ``heads``, ``mlp``, ``vocab`` or None),
and :data:`LOGICAL_AXES` maps a logical name to a mesh axis. The same patterns match a
parameter wherever it sits: in ``params``, in the EMA or frozen reference, in Adam's ``mu``
and ``nu`` and in an accumulated gradient sum, so all of them are sharded alike. A floating
leaf that no rule names gets :data:`DEFAULT_RULE`: its largest dimension that ``fsdp`` divides
is split along ``fsdp`` (a value head, a diffusion transformer's own layers); integer leaves
(step counters, PRNG keys) and scalars are replicated. A dimension that its mesh axis does
not divide is replicated instead; :func:`plan_shardings` lists those leaves, and the leaves
replicated on purpose (norms), in its :class:`ShardingPlan`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from pydantic import Field

from dew.config import Config

DATA_AXIS, FSDP_AXIS, TENSOR_AXIS = "data", "fsdp", "tensor"
MESH_AXES = (DATA_AXIS, FSDP_AXIS, TENSOR_AXIS)
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)  # batch rows are split over these; tensor-parallel devices share rows

# Logical axes of the decoder's parameters (Hugging Face names, as dew.models.transformer keeps them).
# Kernels are [in, out]: column-parallel projections split "out" along tensor, row-parallel ones "in".
RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed_tokens/embedding$", ("vocab", "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),
    (r"(q_proj|k_proj|v_proj)/kernel$", ("embed", "heads")),
    (r"(q_proj|k_proj|v_proj)/bias$", ("heads",)),
    (r"o_proj/kernel$", ("heads", "embed")),
    (r"(gate_proj|up_proj)/kernel$", ("embed", "mlp")),
    (r"down_proj/kernel$", ("mlp", "embed")),
    (r"(norm|layernorm)/scale$", (None,)),  # a few thousand values per layer: replicated on purpose
)
LOGICAL_AXES = {"embed": FSDP_AXIS, "vocab": TENSOR_AXIS, "heads": TENSOR_AXIS, "mlp": TENSOR_AXIS}
DEFAULT_RULE = "fsdp_largest_axis"


class Parallelism(Config):
    """The device mesh of a Trainer (see the module docstring): ``fsdp`` and ``tensor`` sizes, ``data`` the rest."""

    data: int | None = Field(None, ge=1)
    fsdp: int = Field(1, ge=1)
    tensor: int = Field(1, ge=1)

    def shape(self, devices: int) -> tuple[int, int, int]:
        """(data, fsdp, tensor) over ``devices`` devices; raises ValueError when they do not multiply to it."""
        split = self.fsdp * self.tensor
        data = self.data if self.data is not None else devices // split
        if data * split != devices or data < 1:
            given = f"data={self.data}, " if self.data is not None else ""
            raise ValueError(
                f"parallelism {given}fsdp={self.fsdp}, tensor={self.tensor} does not fit {devices} device(s): "
                f"data x fsdp x tensor must equal the device count"
                + ("" if self.data is not None else f" ({devices} is not a multiple of fsdp x tensor = {split})")
            )
        return data, self.fsdp, self.tensor

    def mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The ``("data", "fsdp", "tensor")`` mesh over ``devices`` (default: every device of every process).

        Devices are laid out in order, tensor innermost: the devices of one process stay together along the
        inner axes, so each process holds whole rows of the batch and tensor-parallel products stay on one host.
        """
        devices = list(devices) if devices is not None else jax.devices()
        shape = self.shape(len(devices))
        return Mesh(np.array(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


class MeshOptions(Config):
    """The trainer's mesh and memory options of a pipeline's config (mixed into it).

    fsdp, tensor: the sizes of the Trainer's ``fsdp`` and ``tensor`` mesh axes over every trainer process's
    devices (``trainers`` processes x their local devices); ``data`` takes the rest (default: plain data
    parallelism, the state replicated); remat: what the policy's decoder layers keep for the backward pass
    ("none", "full": recompute each layer, "dots": keep the weight products' outputs).
    """

    fsdp: int = Field(1, ge=1)
    tensor: int = Field(1, ge=1)
    remat: Literal["none", "full", "dots"] = "none"

    def parallelism(self) -> Parallelism:
        return Parallelism(fsdp=self.fsdp, tensor=self.tensor)

    def rematerialised(self, model):
        """``model`` with its decoder layers rematerialised by ``remat`` (a model without the option is refused)."""
        if self.remat == "none":
            return model
        if "remat" not in getattr(model, "__dataclass_fields__", {}):
            raise ValueError(f"remat={self.remat!r} needs a decoder with layer rematerialisation "
                             f"(dew's causal transformer); {type(model).__name__} has none")
        return model.clone(remat=self.remat)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes of ``mesh`` that batch rows are split over."""
    return tuple(axis for axis in BATCH_AXES if axis in mesh.axis_names)


def constrain_rows(x: jax.Array) -> jax.Array:
    """``x`` with its rows split over the batch axes of the mesh being traced under (``jax.set_mesh``), else as is.

    The decoder marks its hidden states so between layers: without the mark, XLA's sharding propagation may
    follow an FSDP-split weight instead and keep every row's activations on every device.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not all(axis in mesh.axis_names for axis in BATCH_AXES):
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(BATCH_AXES))


def batch_devices(mesh: Mesh) -> int:
    """How many ways batch rows are split on ``mesh``."""
    return math.prod(mesh.shape[axis] for axis in batch_axes(mesh))


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Shardings for a tree, and what the rules left whole.

    shardings: a NamedSharding per leaf (the tree's structure); specs: the PartitionSpec per leaf path;
    replicated: paths of floating leaves kept whole on purpose (a rule of None axes: norms);
    undivided: ``(path, dimension, mesh axis)`` for each dimension left whole because the axis does not divide it;
    defaulted: paths that no rule named (they took DEFAULT_RULE).
    """

    shardings: Any
    specs: dict[str, PartitionSpec]
    replicated: tuple[str, ...]
    undivided: tuple[tuple[str, int, str], ...]
    defaulted: tuple[str, ...]


def leaf_path(path) -> str:
    """A tree path as ``params/layers_0/mlp/up_proj/kernel`` (what the rule patterns match)."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def plan_shardings(tree, mesh: Mesh, rules: Sequence[tuple[str, tuple[str | None, ...]]] = RULES) -> ShardingPlan:
    """The sharding of every leaf of ``tree`` (arrays or ShapeDtypeStructs) on ``mesh`` by ``rules``."""
    compiled = [(re.compile(pattern), axes) for pattern, axes in rules]
    specs: dict[str, PartitionSpec] = {}
    replicated, undivided, defaulted = [], [], []

    def spec_of(path, leaf) -> NamedSharding:
        name = leaf_path(path)
        shape = tuple(getattr(leaf, "shape", ()))
        dtype = getattr(leaf, "dtype", None)
        floating = dtype is not None and jax.numpy.issubdtype(dtype, jax.numpy.floating)
        if not shape or not floating:
            spec = PartitionSpec()
        else:
            logical = next((axes for pattern, axes in compiled if pattern.search(name)), None)
            if logical is None:
                defaulted.append(name)
                spec = _default_spec(name, shape, mesh, undivided)
            else:
                if len(logical) != len(shape):
                    raise ValueError(
                        f"the sharding rule for {name!r} names {len(logical)} axes {logical} but the leaf has shape "
                        f"{shape}; fix the rule table or give this leaf a rule of its own"
                    )
                if all(axis is None for axis in logical):
                    replicated.append(name)
                spec = PartitionSpec(*(_mesh_axis(name, dim, size, axis, mesh, undivided)
                                       for dim, (size, axis) in enumerate(zip(shape, logical))))
        specs[name] = spec
        return NamedSharding(mesh, spec)

    shardings = jax.tree_util.tree_map_with_path(spec_of, tree)
    return ShardingPlan(shardings, specs, tuple(replicated), tuple(undivided), tuple(defaulted))


def _mesh_axis(name: str, dim: int, size: int, logical: str | None, mesh: Mesh, undivided: list) -> str | None:
    if logical is None:
        return None
    if logical not in LOGICAL_AXES:
        raise ValueError(f"the sharding rule for {name!r} names the logical axis {logical!r}; "
                         f"known: {sorted(LOGICAL_AXES)} or None")
    axis = LOGICAL_AXES[logical]
    ways = mesh.shape.get(axis, 1)
    if ways == 1:
        return None
    if size % ways:
        undivided.append((name, dim, axis))
        return None
    return axis


def _default_spec(name: str, shape: tuple[int, ...], mesh: Mesh, undivided: list) -> PartitionSpec:
    ways = mesh.shape.get(FSDP_AXIS, 1)
    if ways == 1:
        return PartitionSpec()
    fits = [dim for dim, size in enumerate(shape) if size % ways == 0]
    if not fits:
        undivided.append((name, int(np.argmax(shape)), FSDP_AXIS))
        return PartitionSpec()
    dim = max(fits, key=lambda d: (shape[d], -d))
    return PartitionSpec(*(FSDP_AXIS if d == dim else None for d in range(len(shape))))


def placed(shapes, shardings):
    """Abstract arrays (``jax.ShapeDtypeStruct``) of ``shapes``' leaves, each with its sharding from ``shardings``."""
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                        shapes, shardings)


def device_bytes(tree, device: jax.Device | None = None) -> int:
    """Bytes of ``tree``'s arrays held on ``device`` (default: the first local device), read from their shards."""
    device = device or jax.local_devices()[0]
    total = 0
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total
