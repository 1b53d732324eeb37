"""The record of a training run: what each step consumed beyond the weights, in a run directory.

``Trainer(record=DIR)`` writes, for every batch a step consumes, one Parquet file
``DIR/step-<step>.p<process>.parquet``: the batch the update trained on, after the rollout
(an RL objective's sampled ids, behaviour log-probabilities, versions, rewards and
advantages, masks), one column per field and one row per batch row, with the step, the
committed updates before it, the rollout's figures and the loss in the file's metadata,
a SHA-256 digest of the batch and a digest of the parameters after the update
(:func:`params_digest`). A
step whose rollout returned nothing (no update) is a file without rows, marked skipped.
``DIR/start.p<process>.json`` holds the digest of the parameters the run started from and
the layout it trained on (processes, devices, mesh).

Nothing else is needed to train the run again: :func:`dew.replay.replay` feeds the
recorded batches to a Trainer built as the run's was, without any rollout server, sandbox
or engine, and compares the parameters after every update with the recorded digests.

A run that resumes from a checkpoint writes its steps again from there on (each file is
replaced whole, so the record holds the batches the final parameters came from); a run
that starts from its initial state empties the folder first. Reading checks every file:
an unreadable file, a digest that does not match its batch, a missing step or a file of
another layout raises :class:`RecordError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FORMAT = 1  # the record's layout; a reader refuses another


class RecordError(ValueError):
    """A run record that cannot be trusted or read: the message names the file and what is wrong."""


@dataclass(frozen=True)
class RecordedStep:
    """One step of a record: ``batch`` None when the step made no update."""

    step: int
    updates: int
    batch: dict[str, np.ndarray] | None
    params_digest: str | None
    metrics: dict[str, float]
    path: Path


def params_digest(params) -> str:
    """The digest a record compares parameters by: per leaf, two sums of its bits (as 32-bit words) weighted by odd
    multipliers of their positions, modulo 2**32, computed where the parameters live (every device and process
    together), then SHA-256 over each leaf's path, dtype, shape and sums.

    Any one changed bit changes both sums (an odd weight times a power of two is never 0 modulo 2**32), and modular
    sums do not depend on the order XLA adds in. They run where the parameters are, sharded or not, so a GPU's
    parameters never travel to the host for them (a host SHA-256 of a Qwen3-0.6B shape's 2.4 GB takes 1.4 s here).
    """
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    sums = np.asarray(jax.device_get(_bit_sums([leaf for _, leaf in leaves])))
    digest = hashlib.sha256()
    for (path, leaf), pair in zip(leaves, sums.reshape(len(leaves), 2)):
        digest.update(f"{jax.tree_util.keystr(path)}|{jnp.dtype(leaf.dtype).name}|{tuple(leaf.shape)}|".encode())
        digest.update(pair.astype("<u4").tobytes())
    return digest.hexdigest()


COLUMNS = 1024  # a leaf's words are summed as rows of this many, each row weighted, then the rows


def _odd(count: int, multiplier: int) -> jax.Array:
    """``count`` odd uint32 weights, one per position."""
    return (jax.lax.iota(jnp.uint32, count) * jnp.uint32(multiplier)) | jnp.uint32(1)


@jax.jit
def _bit_sums(leaves: list) -> jax.Array:
    """[2 x leaves] uint32: each leaf's bits as 32-bit words, summed with two odd weights per position (a row's
    weight times a column's, both odd: a product that is odd too), modulo 2**32."""
    out = []
    for leaf in leaves:
        leaf = jnp.asarray(leaf)
        kind = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[leaf.dtype.itemsize]
        words = jax.lax.bitcast_convert_type(leaf, kind).reshape(-1).astype(jnp.uint32)
        body = words.size - words.size % COLUMNS
        rows, tail = words[:body].reshape(-1, COLUMNS), words[body:]
        for column, row in ((2654435761, 2246822519), (3266489917, 668265263)):
            inner = (rows * _odd(COLUMNS, column)[None, :]).sum(axis=1, dtype=jnp.uint32)
            total = (inner * _odd(rows.shape[0], row)).sum(dtype=jnp.uint32)
            # the tail's weights are odd too; its positions follow the rows'
            out.append(total + (tail * _odd(tail.size, row ^ column)).sum(dtype=jnp.uint32))
    return jnp.stack(out) if out else jnp.zeros((0,), jnp.uint32)


def batch_digest(batch: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over the fields in name order: name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    for name in sorted(batch):
        value = np.ascontiguousarray(batch[name])
        digest.update(f"{name}|{value.dtype.name}|{value.shape}|".encode())
        digest.update(value.view(np.uint8).data)
    return digest.hexdigest()


def layout() -> dict:
    """What a step's result depends on beside its inputs: processes, this process's index, devices and platform."""
    return {"processes": jax.process_count(), "process": jax.process_index(), "devices": jax.device_count(),
            "local_devices": jax.local_device_count(), "platform": jax.default_backend(),
            "jax": jax.__version__}


class UpdateRecord:
    """Writes and reads one run's record in ``directory`` (see the module docstring)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory).absolute()
        self.opened = False  # whether this writer has begun or resumed the record

    def open(self, params, step: int, mesh_shape: Mapping[str, int]) -> None:
        """Before a writer's first step: at step 0 a run's start (:meth:`begin`), later a resumed run's."""
        if step == 0:
            self.begin(params, step, mesh_shape)
        else:
            self.resume(step)
        self.opened = True

    # ----- writing ----------------------------------------------------------------------------

    def begin(self, params, step: int, mesh_shape: Mapping[str, int]) -> None:
        """A run starting from ``params`` at ``step``: clear this process's earlier files, note the start."""
        self.directory.mkdir(parents=True, exist_ok=True)
        process = jax.process_index()
        for stale in self.directory.glob(f"step-*.p{process}.parquet"):
            stale.unlink()
        start = {"format": FORMAT, "step": step, "params_digest": params_digest(params),
                 "mesh": {name: int(size) for name, size in mesh_shape.items()}, **layout()}
        _write_atomic(self._start_path(process), json.dumps(start, indent=2).encode())

    def resume(self, step: int) -> None:
        """A run restored at ``step``: its record must go back to the run's start."""
        path = self._start_path(jax.process_index())
        if not path.exists():
            raise RecordError(f"the run resumes at step {step} but {path} is missing: a record covers a run from its "
                              "start (turn record on before the first step, or record into a fresh directory)")

    def write(self, step: int, updates: int, batch: Mapping[str, np.ndarray] | None, params,
              metrics: Mapping[str, float]) -> int:
        """Step ``step`` (counted from 0) consumed ``batch`` (None: no update) at ``updates`` committed updates;
        returns the bytes written."""
        meta = {"format": FORMAT, "step": step, "updates": updates, "skipped": batch is None,
                "metrics": {name: float(value) for name, value in metrics.items()}}
        fields, columns = [], []
        if batch is not None:
            host = {name: np.asarray(value) for name, value in batch.items()}
            meta["batch_digest"] = batch_digest(host)
            meta["params_digest"] = params_digest(params)
            for name, value in host.items():
                field, column = _column(name, value)
                fields.append(field)
                columns.append(column)
        table = pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata={"dew": json.dumps(meta)}))
        path = self.step_path(step, jax.process_index())
        partial = path.with_name(path.name + ".partial")
        pq.write_table(table, partial, compression="zstd")
        written = partial.stat().st_size
        os.replace(partial, path)  # a crash mid-write leaves the previous file or none, never half of one
        return written

    # ----- reading ----------------------------------------------------------------------------

    def start(self) -> dict:
        """The start file of a one-process record (format, step, parameters' digest, layout)."""
        starts = sorted(self.directory.glob("start.p*.json"))
        if not starts:
            raise RecordError(f"{self.directory} holds no run record (no start.p<process>.json)")
        if len(starts) > 1:
            raise RecordError(f"{self.directory} is the record of {len(starts)} trainer processes "
                              f"({', '.join(p.name for p in starts)}); replay covers runs of one trainer process")
        path = starts[0]
        try:
            start = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise RecordError(f"{path} is not a record's start file: {error}") from error
        if not isinstance(start, dict) or start.get("format") != FORMAT:
            raise RecordError(f"{path} has record format {start.get('format') if isinstance(start, dict) else None!r}"
                              f", this reader reads format {FORMAT}")
        return start

    def steps(self, until: int | None = None) -> Iterator[RecordedStep]:
        """The recorded steps in order from the start, each checked; ``until``: stop after that many steps."""
        start = self.start()
        process = start["process"]
        found = sorted(int(p.name.split(".")[0].removeprefix("step-")) for p in self.directory.glob(
            f"step-*.p{process}.parquet"))
        step = start["step"]
        last = found[-1] if found else step - 1
        if until is not None:
            last = min(last, until - 1)
        while step <= last:
            path = self.step_path(step, process)
            if not path.exists():
                raise RecordError(f"{path} is missing: the record has steps {found[0]}..{found[-1]} with a gap at "
                                  f"step {step}")
            yield read_step(path, step)
            step += 1

    def step_path(self, step: int, process: int) -> Path:
        return self.directory / f"step-{step:08d}.p{process}.parquet"

    def _start_path(self, process: int) -> Path:
        return self.directory / f"start.p{process}.json"


def read_step(path: Path, step: int) -> RecordedStep:
    """One step file, checked: readable, of this format and step, its batch equal to its digest."""
    try:
        table = pq.read_table(path)
        meta = json.loads((table.schema.metadata or {})[b"dew"])
    except (OSError, KeyError, ValueError, pa.ArrowException) as error:
        raise RecordError(f"{path} is not a readable record step: {error}") from error
    if meta.get("format") != FORMAT or meta.get("step") != step:
        raise RecordError(f"{path} holds step {meta.get('step')!r} of format {meta.get('format')!r}, expected step "
                          f"{step} of format {FORMAT}")
    if meta["skipped"]:
        return RecordedStep(step, meta["updates"], None, None, meta["metrics"], path)
    try:
        batch = {name: _array(table.schema.field(name), table.column(name)) for name in table.column_names}
    except (ValueError, KeyError, pa.ArrowException) as error:
        raise RecordError(f"{path}: a batch field cannot be read back: {error}") from error
    if batch_digest(batch) != meta.get("batch_digest"):
        raise RecordError(f"{path}: the batch does not match its recorded digest (the file was changed or damaged)")
    return RecordedStep(step, meta["updates"], batch, meta["params_digest"], meta["metrics"], path)


# ----- a field as a Parquet column and back --------------------------------------------------------

_NATIVE = {np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                                 np.uint64, np.float16, np.float32, np.float64)}


def _column(name: str, value: np.ndarray) -> tuple[pa.Field, pa.Array]:
    """``value`` [rows, ...] as one column: a row per batch row, its trailing axes flattened into a fixed-size list;
    a dtype Arrow lacks (bfloat16) travels as the unsigned integer of its width."""
    if value.ndim == 0:
        raise ValueError(f"batch field {name!r} is a scalar; every field needs a leading row axis")
    native = value.dtype in _NATIVE
    flat = np.ascontiguousarray(value if native else value.view(f"u{value.dtype.itemsize}")).reshape(len(value), -1)
    column = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])
    meta = {"dtype": value.dtype.name, "shape": list(value.shape), "viewed": not native}
    return pa.field(name, column.type, metadata={"dew": json.dumps(meta)}), column


def _array(field: pa.Field, column: pa.ChunkedArray) -> np.ndarray:
    meta = json.loads((field.metadata or {})[b"dew"])
    flat = column.combine_chunks().flatten().to_numpy(zero_copy_only=False)
    if meta["viewed"]:  # stored as the unsigned integer of its width: the same bits, viewed back
        return flat.view(getattr(ml_dtypes, meta["dtype"])).reshape(meta["shape"])
    return flat.astype(np.dtype(meta["dtype"]), copy=False).reshape(meta["shape"])


def _write_atomic(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)
