"""Pack token documents into fixed-width rows with segment ids and positions."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pack_documents(documents: Sequence[Sequence[int]], width: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Pack documents in order into rows of ``width`` ids (next fit).

    Returns ``text``, ``text_segment_ids`` (1, 2, ... per document within a row; 0 on
    padding) and ``text_positions`` (0 at each document's first id), each
    ``[rows, width]`` int32. A document that does not fit the room left in a row
    starts the next one; a document longer than ``width`` raises.
    """
    if width < 2:
        raise ValueError(f"width must be at least 2, got {width}")
    rows: list[list[tuple[int, list[int]]]] = [[]]
    used = 0
    for index, document in enumerate(documents):
        document = [int(token) for token in document]
        if not document:
            continue
        if len(document) > width:
            raise ValueError(f"document {index} has {len(document)} ids, more than the row width {width}")
        if used + len(document) > width:
            rows.append([])
            used = 0
        rows[-1].append((index, document))
        used += len(document)
    rows = [row for row in rows if row]
    text = np.full((len(rows), width), pad_id, np.int32)
    segments = np.zeros((len(rows), width), np.int32)
    positions = np.zeros((len(rows), width), np.int32)
    for r, row in enumerate(rows):
        start = 0
        for segment, (_, document) in enumerate(row, start=1):
            end = start + len(document)
            text[r, start:end] = document
            segments[r, start:end] = segment
            positions[r, start:end] = np.arange(len(document))
            start = end
    return {"text": text, "text_segment_ids": segments, "text_positions": positions}
