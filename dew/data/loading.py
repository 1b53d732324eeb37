"""Reading records in parallel, partitioned across processes, into resumable batch streams.

Every file loader (PreferencePairs, Prompts, ...) follows the same path:

1. read its records from memory (``records=``, JSON strings or mappings) or a file
   (``path=``, Parquet or JSON lines), keeping each record's source and row number for
   error messages;
2. keep only this process's partition: record ``i`` belongs to process ``i % count``,
   so each process decodes and encodes only its own records;
3. encode the partition with :class:`Loading`'s workers or threads, in record order,
   validating every record up front so a bad row fails at ``load`` and not mid-run;
4. serve fixed-shape batches from a :class:`RecordStream`, which shuffles its partition
   with ``(seed, epoch)`` each epoch and reports its position to the trainer's
   checkpoints (:class:`~dew.data.dataset.StreamPosition`).

The global batch is every process's local batch together, so a batch of ``B`` rows
needs ``B`` divisible by the number of processes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import multiprocessing
import pickle
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dew.data.dataset import Dataset, Partition, local_partition
from dew.validation import integer, positive_int


class RecordError(ValueError):
    """A record that cannot be used; the message names its source, row and field."""


@dataclasses.dataclass(frozen=True)
class Record:
    """One input record with where it came from: ``source`` (a file or ``records``) and ``row``."""

    source: str
    row: int
    fields: Mapping[str, Any]

    def error(self, field: str | None, problem: str) -> RecordError:
        where = f"{self.source} row {self.row}" + (f", field {field!r}" if field else "")
        return RecordError(f"{where}: {problem}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Loading:
    """How a loader reads and encodes its records.

    workers: processes that encode records (0 encodes in this process). They start with
    multiprocessing's "spawn", so a script that uses them needs the usual
    ``if __name__ == "__main__":`` guard around its entry point, and each start costs
    a fresh interpreter, the script's own imports and the loader's tokenizer (about
    2 s for ChatMessages with the Qwen vocabulary on a 2-core machine): workers pay
    for themselves on thousands of records, not hundreds.
    threads: threads that encode records when ``workers`` is 0 (tokenizers release the GIL).
    read_buffer: chunks of records submitted ahead of the one being collected, which
    bounds the memory the parallel pass holds.
    shuffle: reorder each epoch with ``(seed, epoch)``; False keeps file order.
    seed: the shuffle seed; the same seed gives the same batches.
    """

    workers: int = 0
    threads: int = 1
    read_buffer: int = 2
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self):
        for name, least in (("workers", 0), ("threads", 1), ("read_buffer", 1)):
            integer(f"Loading.{name}", getattr(self, name), at_least=least)

    def encode(self, records: Sequence[Record], encode_many: Callable[[Sequence[Record]], list], chunk: int = 256) -> list:
        """``encode_many(records)``, in order, a chunk at a time spread over the workers or threads."""
        if self.workers == 0 and self.threads == 1:
            return encode_many(records)
        with contextlib.ExitStack() as stack:
            if self.workers > 0:
                # spawn, not fork: the parent may hold JAX's threads, which fork would copy mid-flight.
                # encode_many (its loader and tokenizer: megabytes) goes to a file every worker reads at
                # its start: passed as the workers' start argument, it would be written to one starting
                # worker at a time, each write waiting for that worker's interpreter to come up.
                held = stack.enter_context(tempfile.NamedTemporaryFile(prefix="dew-loader-", suffix=".pickle"))
                pickle.dump(encode_many, held)
                held.flush()
                executor = concurrent.futures.ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_hold_encoder, initargs=(held.name,),
                )
                run = _encode_held
            else:
                executor = concurrent.futures.ThreadPoolExecutor(self.threads)
                run = encode_many
            return self._spread(records, run, executor, chunk)

    def _spread(self, records: Sequence[Record], run: Callable[[Sequence[Record]], list], executor, chunk: int) -> list:
        # A few chunks per worker or thread, so none waits on one long last chunk.
        chunk = max(1, min(chunk, -(-len(records) // (4 * (self.workers or self.threads)))))
        chunks = [records[start : start + chunk] for start in range(0, len(records), chunk)]
        out: list = []
        with executor:
            pending = []
            for piece in chunks:
                pending.append(executor.submit(run, piece))
                if len(pending) > self.read_buffer:
                    out.extend(pending.pop(0).result())
            for future in pending:
                out.extend(future.result())
        return out


_held_encoder: Callable[[Sequence[Record]], list] | None = None


def _hold_encoder(path: str) -> None:
    global _held_encoder
    with open(path, "rb") as file:
        _held_encoder = pickle.load(file)


def _encode_held(records: Sequence[Record]) -> list:
    return _held_encoder(records)


def read_records(records: Iterable[str | Mapping] | None, path: str | Path | None, owner: str) -> list[Record]:
    """Records from exactly one of ``records`` (JSON strings or mappings) and ``path`` (Parquet or JSONL)."""
    if (records is None) == (path is None):
        given = "both records and path" if records is not None else "neither records nor path"
        raise ValueError(f"{owner} takes exactly one of records= and path=, got {given}")
    if records is not None:
        if isinstance(records, (str, bytes, Mapping)):
            raise TypeError(f"{owner}: records must be a sequence of JSON strings or mappings, got a single {type(records).__name__}")
        return [_parse("records", row, item) for row, item in enumerate(records)]
    return read_file(Path(path), owner)


def _parse(source: str, row: int, item) -> Record:
    """A Record from a mapping or its JSON text, or a RecordError naming source and row."""
    record = Record(source, row, {})
    if isinstance(item, (str, bytes)):
        try:
            item = json.loads(item)
        except json.JSONDecodeError as error:
            raise record.error(None, f"not valid JSON ({error})") from None
    if not isinstance(item, Mapping):
        raise record.error(None, f"expected a JSON object, got {type(item).__name__}")
    return Record(source, row, item)


SAVED_DATASET_MARKERS = ("dataset_info.json", "dataset_dict.json")  # what save_to_disk writes into its directory


def read_saved_dataset(path: Path, split: str | None, owner: str) -> list[Record]:
    """The rows of a directory written by ``datasets``' ``save_to_disk`` (a Dataset, or ``split`` of a DatasetDict)."""
    import datasets  # slow to import; only a saved directory needs it

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split is None or split not in loaded:
            wanted = f"not {split!r}" if split is not None else "and no split was named"
            raise ValueError(f"{owner}: {path} has splits {sorted(loaded)}, {wanted}; give a "
                             f"split's own directory, such as {path / sorted(loaded)[0]}")
        loaded = loaded[split]
    return [Record(str(path), row, item) for row, item in enumerate(loaded)]


def read_file(path: Path, owner: str) -> list[Record]:
    """Records of a Parquet or JSON-lines file, or of a directory written by ``save_to_disk``."""
    if not path.exists():
        raise FileNotFoundError(f"{owner}: {path} does not exist")
    if path.is_dir():
        if not any((path / marker).exists() for marker in SAVED_DATASET_MARKERS):
            raise ValueError(f"{owner}: {path} is a directory but not one datasets' save_to_disk wrote (it has no "
                             f"{' or '.join(SAVED_DATASET_MARKERS)})")
        return read_saved_dataset(path, None, owner)
    if path.suffix in (".jsonl", ".json"):
        with path.open() as lines:
            return [_parse(str(path), row, line) for row, line in enumerate(lines) if line.strip()]
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as error:  # pyarrow raises several types for a bad file
        raise ValueError(f"{owner}: cannot read {path} as Parquet ({type(error).__name__}: {error})") from None
    return [Record(str(path), row, item) for row, item in enumerate(table.to_pylist())]


def partition_of(records: Sequence[Record], partition: Partition) -> list[Record]:
    """This process's records: every ``count``-th record starting at ``index``."""
    return list(records[partition.index :: partition.count])


class RecordStream:
    """Fixed-shape batches of encoded rows from one process's partition, resumable.

    ``columns`` maps field names to arrays whose first axis indexes the partition's
    records. Each epoch visits ``batches_per_epoch`` batches of ``rows`` records in the
    order ``permutation((seed, epoch))`` (or file order); the remainder of an epoch is
    left for the next epoch's shuffle, so every batch has the same shape.
    """

    def __init__(self, columns: Mapping[str, np.ndarray], rows: int, batches_per_epoch: int, loading: Loading):
        self.columns, self.rows, self.loading = dict(columns), rows, loading
        self.batches_per_epoch = batches_per_epoch
        self.epoch, self.batch_index = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> np.ndarray:
        count = len(next(iter(self.columns.values())))
        if not self.loading.shuffle:
            return np.arange(count)
        return np.random.default_rng((self.loading.seed, self.epoch)).permutation(count)

    def position(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch_index}

    def restore(self, position: dict) -> None:
        self.epoch, self.batch_index = int(position["epoch"]), int(position["batch"])
        self._order = self._permutation()

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.batch_index == self.batches_per_epoch:
            self.epoch, self.batch_index = self.epoch + 1, 0
            self._order = self._permutation()
        chosen = self._order[self.batch_index * self.rows : (self.batch_index + 1) * self.rows]
        self.batch_index += 1
        return {name: column[chosen] for name, column in self.columns.items()}


def local_rows(batch: int, partition: Partition, owner: str) -> int:
    positive_int(f"{owner}.load: batch", batch)
    if batch % partition.count:
        raise ValueError(f"{owner}.load: a batch of {batch} rows does not split across {partition.count} processes")
    return batch // partition.count


def batches_per_epoch(total_records: int, batch: int, partition: Partition, owner: str) -> int:
    """Batches every process can serve per epoch: its share of records, in whole local batches."""
    rows = batch // partition.count
    smallest_partition = total_records // partition.count
    count = smallest_partition // rows
    if count == 0:
        raise ValueError(
            f"{owner}.load: {total_records} records give each of {partition.count} process(es) fewer than "
            f"one batch of {rows} rows"
        )
    return count


def row_stream(rows: Mapping[str, np.ndarray], batch: int, loading: Loading, owner: str):
    """A Dataset's ``train`` over rows already encoded (columns of equal length): each process reads every
    ``count``-th row from its index, in fixed batches of its share of ``batch``, reshuffled each epoch."""
    total = len(next(iter(rows.values())))

    def train(partition: Partition) -> RecordStream:
        mine = {name: column[partition.index :: partition.count] for name, column in rows.items()}
        return RecordStream(mine, local_rows(batch, partition, owner), batches_per_epoch(total, batch, partition, owner),
                            loading)

    return train


class PartitionedLoader:
    """What every loader shares: its records, their encoding per partition and ``load``.

    Subclasses set ``owner`` (their name, for messages) and implement ``encode(record)``
    returning a dict of fixed-shape arrays for one record.
    """

    owner = "loader"

    def __init__(self, records: list[Record], loading: Loading | None):
        if loading is not None and not isinstance(loading, Loading):
            raise TypeError(f"{self.owner}: loading must be a Loading, got {type(loading).__name__}")
        if not records:
            raise ValueError(f"{self.owner}: no records to load")
        self.loading = loading or Loading()
        self.records = records
        self._encoded: dict[Partition, dict[str, np.ndarray]] = {}

    def encode(self, record: Record) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def encode_many(self, records: Sequence[Record]) -> list:
        """``[encode(r) for r in records]``; a loader that encodes faster in batches overrides it."""
        return [self.encode(record) for record in records]

    def collate(self, encoded: list) -> dict[str, np.ndarray]:
        """Columns from the encoded records of a partition (default: stacked, one row per record)."""
        return stack(encoded)

    def columns(self, partition: Partition) -> dict[str, np.ndarray]:
        """This partition's records, encoded and collated (cached)."""
        if partition not in self._encoded:
            encoded = self.loading.encode(partition_of(self.records, partition), self.encode_many)
            self._encoded[partition] = self.collate(encoded)
        return self._encoded[partition]

    def load(self, batch: int):
        """A Dataset of fixed-shape batches of ``batch`` rows (all processes together).

        Encodes this process's records now, so a bad record raises here rather than
        during training.
        """
        here = local_partition()
        local_rows(batch, here, self.owner)
        batches_per_epoch(len(self.records), batch, here, self.owner)
        self.columns(here)

        def train(partition: Partition) -> RecordStream:
            rows = local_rows(batch, partition, self.owner)
            per_epoch = batches_per_epoch(len(self.records), batch, partition, self.owner)
            return RecordStream(self.columns(partition), rows, per_epoch, self.loading)

        return Dataset(train=train, val=None, records=len(self.records), batch=batch)


def stack(rows: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Stack encoded rows (dicts of equal-shape arrays) into columns."""
    names = rows[0].keys()
    return {name: np.stack([row[name] for row in rows]) for name in names}


__all__ = [
    "Loading", "PartitionedLoader", "Record", "RecordError", "RecordStream", "batches_per_epoch", "local_rows",
    "partition_of", "read_records", "row_stream", "stack",
]
