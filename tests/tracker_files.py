"""Readers for what the experiment trackers wrote, so tests check the files users open, not the writers' calls.

TensorBoard: TFRecord framing (u64 length, u32 masked CRC, payload, u32 masked CRC) of
``Event`` protos, parsed with tensorboardX's own generated proto classes.
W&B: the ``.wandb`` transaction log of an offline run, as wandb-core writes it (wandb
0.31, core/pkg/leveldb in github.com/wandb/wandb): a 7-byte header (":W&B", 0xBEE1,
version 0), then LevelDB log records in 32 KiB blocks (u32 CRC, u16 length, u8 type:
1 full, 2 first, 3 middle, 4 last), whose payloads are ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from tensorboardX.proto import event_pb2
from wandb.proto import wandb_internal_pb2


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files under ``logdir``: tag -> [(step, value)], files in name order, TensorBoard's
    purge applied (a SessionLog START at step S hides earlier-written points at steps >= S)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack_from("<Q", data, at)
            event = event_pb2.Event.FromString(data[at + 12: at + 12 + length])
            at += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                for tag in series:
                    series[tag] = [(step, value) for step, value in series[tag] if step < event.step]
            for value in event.summary.value:
                series.setdefault(value.tag, []).append((event.step, value.simple_value))
    return series


def _wandb_payloads(data: bytes):
    block, at, pending = 32768, 7, b""
    assert data[:4] == b":W&B", "not a W&B transaction log"
    while at + 7 <= len(data):
        if block - at % block < 7:  # a block's tail too short for a header is padding
            at += block - at % block
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, at)
        if kind == 0 and length == 0:
            at += block - at % block
            continue
        payload = data[at + 7: at + 7 + length]
        at += 7 + length
        if kind == 1:
            yield payload
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            yield pending + payload
            pending = b""


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows (``run.log`` calls) of an offline W&B run's ``run-<id>.wandb`` file."""
    rows = []
    for payload in _wandb_payloads(Path(run_file).read_bytes()):
        record = wandb_internal_pb2.Record.FromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
