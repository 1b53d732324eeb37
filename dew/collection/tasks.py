"""Converters from a data batch to the scheduler's Tasks: ``task_ids`` and ``prompt_tasks``.

``RolloutScheduler(..., tasks=...)`` takes one of these (or any callable batch ->
list[Task]); without one, :func:`infer_tasks` picks by the batch's fields.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from dew.data.dataset import Batch
from dew.data.prompts import METADATA, metadata_texts, prompt_rows
from dew.records.session_records import Task


def task_ids(batch: Batch) -> list[Task]:
    """Tasks from integer ``task_id`` rows: ``Task(str(id), {"task_id": id})``."""
    if "task_id" not in batch:
        raise KeyError(f"task_ids needs a 'task_id' field; the batch has {sorted(batch)}")
    ids = np.asarray(batch["task_id"])
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"task_id must be a [rows] integer array, got shape {ids.shape} dtype {ids.dtype}")
    return [Task(str(int(i)), {"task_id": int(i)}) for i in ids]


def prompt_tasks(batch: Batch) -> list[Task]:
    """Tasks from Prompts rows: left-padded ``prompt``, ``prompt_length`` and the UTF-8 reward fields.

    Each task's data holds ``prompt_ids`` and the reward fields as strings; its id is a
    checksum of the prompt and its fields (advantages group by the scheduler's group id).
    """
    rows = prompt_rows(batch, "prompt_tasks")
    texts = {field: metadata_texts(batch, field, len(rows)) for field in METADATA}
    tasks = []
    for row, ids in enumerate(rows):
        data: dict[str, Any] = {"prompt_ids": ids, **{field: texts[field][row] for field in METADATA}}
        digest = zlib.crc32(repr((ids, [data[f] for f in METADATA])).encode())
        tasks.append(Task(f"prompt-{digest:08x}", data))
    return tasks


def infer_tasks(batch: Batch) -> list[Task]:
    if "task_id" in batch:
        return task_ids(batch)
    if "prompt" in batch:
        return prompt_tasks(batch)
    raise KeyError(f"cannot tell the batch's tasks: it has neither 'task_id' nor 'prompt' (fields {sorted(batch)}); "
                   "pass tasks=task_ids, tasks=prompt_tasks or your own converter")
