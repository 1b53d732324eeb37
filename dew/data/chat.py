"""Roles of tokens in a conversation.

Each token of a chat row carries the role of the message it came from, stored as a
small integer (``np.int8``) in the ``text_roles`` column. ``LMObjective(loss_role=...)``
counts only targets of one role, usually ``Role.ASSISTANT``.
"""

from __future__ import annotations

import enum


class Role(enum.IntEnum):
    """The role value of a token. ``PAD`` marks padding, which never counts as a target."""

    PAD = 0
    SYSTEM = 1
    USER = 2
    ASSISTANT = 3
    TOOL = 4
