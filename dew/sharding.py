"""Batch sharding and multi-process set-up: the rows of a batch over a mesh's batch axes.

A mesh (:mod:`dew.parallelism`) splits batch rows over its ``data`` and ``fsdp`` axes. A
process holds only its own rows of a global batch (:func:`shard_batch` assembles the
global array from process-local shards), so each process reads only its partition of the
data. How the training state is split is :mod:`dew.parallelism`'s rule table.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew.data.dataset import Partition, local_partition
from dew.parallelism import DATA_AXIS, Parallelism, batch_axes, batch_devices


def data_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The replicated data-parallel mesh over ``devices`` (default: every device of every process)."""
    return Parallelism().mesh(devices)


def mesh_of(variables, default: Mesh | None = None) -> Mesh:
    """The trainer's mesh, read from the variables' sharding (else ``default``, else the data mesh of every device)."""
    for leaf in jax.tree.leaves(variables):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and DATA_AXIS in sharding.mesh.axis_names:
            return sharding.mesh
    return default if default is not None else data_mesh()


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def row_sharded(mesh: Mesh) -> NamedSharding:
    """Rows split over the mesh's batch axes (``data`` x ``fsdp``), the rest of each row whole."""
    return NamedSharding(mesh, PartitionSpec(batch_axes(mesh)))


def shard_batch(batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Place this process's rows of a batch as one global, row-sharded array per field.

    Every field must have the same number of rows; the global batch (rows times the
    number of processes) must divide evenly across the mesh's devices.
    """
    if not batch:
        raise ValueError("the batch is empty: it has no fields")
    rows = None
    for name, value in batch.items():
        shape = np.shape(value)
        if len(shape) == 0:
            raise ValueError(f"batch field {name!r} is a scalar; every field needs a leading row axis")
        if rows is None:
            rows, first = shape[0], name
        elif shape[0] != rows:
            raise ValueError(f"batch field {name!r} has {shape[0]} rows but field {first!r} has {rows}")
    global_rows = rows * jax.process_count()
    devices = batch_devices(mesh)
    if global_rows % devices:
        raise ValueError(
            f"a batch of {global_rows} rows does not divide across {devices} devices; "
            f"use a batch size that is a multiple of {devices}"
        )
    sharding = row_sharded(mesh)
    out = {}
    for name, value in batch.items():
        value = np.asarray(value)
        global_shape = (global_rows, *value.shape[1:])
        out[name] = jax.make_array_from_process_local_data(sharding, value, global_shape)
    return out


def initialize_processes(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    local_device_count: int | None = None,
) -> Partition:
    """Join a multi-process JAX job and return this process's data partition.

    On CPU the processes exchange collectives through gloo. ``local_device_count``
    sets how many CPU devices this process exposes; it must be called before JAX
    creates its backends (before the first array is made).
    """
    if local_device_count is not None:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
        flags.append(f"--xla_force_host_platform_device_count={local_device_count}")
        os.environ["XLA_FLAGS"] = " ".join(flags)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )
    return local_partition()


# ----- meetings of the processes of a multi-process job ------------------------------------------

MESSAGE_BYTES = 8192  # what each process sends at a meeting: a fixed size, so every process gathers alike
CAUSE_CHARS = 2000


def describe_error(error: BaseException | None) -> str | None:
    """``"Type: message"``, cut so that its JSON form stays within CAUSE_CHARS."""
    if error is None:
        return None
    text = f"{type(error).__name__}: {error}"
    if len(json.dumps(text)) > CAUSE_CHARS:
        text = text[: CAUSE_CHARS // 6 - 3] + "..."  # JSON writes a character as at most 6 ("\u0001")
    return text


def exchange(payload: dict) -> list[dict]:
    """Every process's ``payload`` (JSON), in process order; a collective every process must call."""
    data = json.dumps(payload).encode()
    if len(data) > MESSAGE_BYTES:  # payloads are bounded (causes are cut to CAUSE_CHARS); this is a bug
        raise AssertionError(f"a meeting payload of {len(data)} bytes exceeds {MESSAGE_BYTES}")
    buffer = np.zeros(MESSAGE_BYTES, np.uint8)
    buffer[: len(data)] = np.frombuffer(data, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(buffer))  # [processes, bytes]
    return [json.loads(bytes(row).rstrip(b"\0")) for row in gathered]


def raise_failures(everyone: list[dict], error: BaseException | None, what: str) -> None:
    """Raise on every process when any process reported an error at this meeting.

    The failing process raises its own ``error`` (with a note that the others were told);
    the others raise a RuntimeError naming each failing process and its cause.
    """
    failed = [(process, theirs["error"]) for process, theirs in enumerate(everyone) if theirs.get("error")]
    if not failed:
        return
    if error is not None:
        error.add_note(f"{what} failed on process {jax.process_index()} of {len(everyone)}; "
                       "every other process raises too")
        raise error
    causes = "; ".join(f"process {process}: {cause}" for process, cause in failed)
    raise RuntimeError(
        f"{what} failed on process {', '.join(str(p) for p, _ in failed)} of {len(everyone)} ({causes}); "
        "every process stops here"
    )


def collective_host(tree):
    """``tree`` in host memory on every process; sharded leaves are gathered (a collective).

    Leaf by leaf, each written once into its host array: the host holds the copy being built plus
    one shard, never a second copy (``np.asarray`` of a sharded array would also keep one cached
    on the device array for as long as the array lives).
    """

    def leaf(x):
        if not isinstance(x, jax.Array):
            return np.array(x, copy=True)
        if x.is_fully_replicated:
            # A copy: on CPU a host view of the buffer would change when the trainer donates it.
            return np.array(x.addressable_data(0), copy=True)
        if not x.is_fully_addressable:
            return multihost_utils.process_allgather(x, tiled=True)
        out = np.empty(x.shape, x.dtype)
        written = set()
        for shard in x.addressable_shards:
            place = tuple((part.start, part.stop) for part in shard.index)
            if place not in written:  # replicas of one block (tensor-parallel copies) are written once
                written.add(place)
                out[shard.index] = np.asarray(shard.data)
        return out

    return jax.tree.map(leaf, tree)


def process_rows(array: jax.Array) -> np.ndarray:
    """This process's rows of a row-sharded global array, in the order shard_batch placed them."""
    shards = {}
    for shard in array.addressable_shards:
        shards.setdefault(shard.index[0].start or 0, shard)  # replicas of one row block hold the same rows
    return np.concatenate([np.asarray(shards[start].data) for start in sorted(shards)])
