"""Pack token documents into fixed-width rows with segment ids and positions."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pack_documents(
    documents: Sequence[Sequence[int]],
    width: int,
    pad_id: int = 0,
    roles: Sequence[Sequence[int]] | None = None,
) -> dict[str, np.ndarray]:
    """Pack documents in order into rows of ``width`` ids (next fit).

    Returns ``text``, ``text_segment_ids`` (1, 2, ... per document within a row; 0 on
    padding) and ``text_positions`` (0 at each document's first id), each
    ``[rows, width]`` int32, plus ``text_roles`` (int8, 0 on padding) when ``roles``
    gives one role per id of each document. A document that does not fit the room
    left in a row starts the next one; a document longer than ``width`` raises.
    """
    if width < 2:
        raise ValueError(f"width must be at least 2, got {width}")
    if roles is not None and len(roles) != len(documents):
        raise ValueError(f"{len(roles)} role lists for {len(documents)} documents")
    rows: list[list[int]] = [[]]
    used = 0
    for index, document in enumerate(documents):
        if len(document) == 0:
            continue
        if len(document) > width:
            raise ValueError(f"document {index} has {len(document)} ids, more than the row width {width}")
        if roles is not None and len(roles[index]) != len(document):
            raise ValueError(f"document {index} has {len(document)} ids but {len(roles[index])} roles")
        if used + len(document) > width:
            rows.append([])
            used = 0
        rows[-1].append(index)
        used += len(document)
    rows = [row for row in rows if row]
    out = {
        "text": np.full((len(rows), width), pad_id, np.int32),
        "text_segment_ids": np.zeros((len(rows), width), np.int32),
        "text_positions": np.zeros((len(rows), width), np.int32),
    }
    if roles is not None:
        out["text_roles"] = np.zeros((len(rows), width), np.int8)
    for r, row in enumerate(rows):
        start = 0
        for segment, index in enumerate(row, start=1):
            end = start + len(documents[index])
            out["text"][r, start:end] = documents[index]
            out["text_segment_ids"][r, start:end] = segment
            out["text_positions"][r, start:end] = np.arange(end - start)
            if roles is not None:
                out["text_roles"][r, start:end] = roles[index]
            start = end
    return out
