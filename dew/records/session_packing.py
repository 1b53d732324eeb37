"""``pack``: sessions into one fixed-shape training batch, and the sizes that go with it.

``pack(sessions, width, rows=None, estimator="group", truncation="mask")`` merges each
session's calls into chains (call k + 1 joins call k's chain only when its prompt starts
with every id of the chain so far), places the chains first-fit into ``[rows, width]``
rows with segment ids and positions, and aligns every column with ``input_ids`` (see
its docstring). ``chain_lengths`` and ``rows_needed`` size a batch beforehand;
``session_advantages`` gives the group-relative advantages pack writes.

``layout=SharedPromptRows(prompt, continuations, length)`` writes the prompt a group's samples
share once: the chains of one group (task and group) that start with the same first prompt
become one *unit*, a row of its own: the prompt but its last id as one segment in the row's
first ``prompt`` ids, then each chain from that last id on as a segment of its own in one of
``continuations`` slots of ``length`` ids (the longest first, each in the first slot with room
left, so short continuations share a slot), whose ids also attend to the whole prompt segment
(``text_prefix_segments`` names it; the decoder's packed mask reads it, and its attention
computes only the slots' blocks: :mod:`dew.models.packed_attention`), positions continuing the
prompt's. Every id then sees exactly the prefix it saw in its own chain, so each
log-probability is the same as in the plain layout, and a group of G samples of a P-id prompt
takes about ``P - 1 + G x (R + 1)`` ids for responses of R on average instead of ``G x (P + R)``:
the training forward and backward pass cost about that much less (half, for 8 samples of a
60-id prompt and 32-id answers). A group whose chains overflow a row's slots takes more rows,
each with the prompt again; a prompt or a chain longer than the layout's room raises.
``fitted_layout`` names the narrowest rows (fewer or shorter slots) a batch's chains fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from dew.losses.advantages import group_advantages
from dew.models.packed_attention import SharedPromptRows
from dew.records.actions import check_call
from dew.records.session_records import Call, Session, check_options, check_truncation, training_reward
from dew.validation import integer, positive_int


@dataclasses.dataclass
class Chain:
    """One strict chain of a session's calls: its ids and, aligned with them, what each id is."""

    session: int
    ids: list = dataclasses.field(default_factory=list)
    response: list = dataclasses.field(default_factory=list)
    behavior: list = dataclasses.field(default_factory=list)
    old: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)
    calls: list = dataclasses.field(default_factory=list)
    routed: list = dataclasses.field(default_factory=list)  # (call, record) in call order
    support: list = dataclasses.field(default_factory=list)  # (chain position, kept ids)
    members: list = dataclasses.field(default_factory=list)  # (call index, where its sampled ids start, how many)
    has_old: bool = True

    def __len__(self) -> int:
        return len(self.ids)


def chains_of(session: Session, number: int) -> list[Chain]:
    """The chains of a session that hold sampled ids: the ones that take rows and loss mass."""
    return [c for c in strict_chains(session, number) if any(c.response)]


def strict_chains(session: Session, number: int = 0) -> list[Chain]:
    """Every chain of the session's calls, in call order: call k + 1 joins when its prompt starts with the whole
    chain. A call that sampled nothing keeps its place (``members``); ``number`` tags the chains' session."""
    chains: list[Chain] = []
    chain = None
    for index, call in enumerate(session.calls):
        where = f"{session.describe()}, call {index}"
        if not isinstance(call, Call):
            raise TypeError(f"{where}: expected a Call, got {type(call).__name__}")
        check_call(where, call)
        prompt = [int(i) for i in call.prompt_ids]
        if chain is not None and len(prompt) >= len(chain) and prompt[: len(chain)] == chain.ids:
            new = prompt[len(chain):]
        else:
            chain = Chain(number)
            chains.append(chain)
            new = prompt
        chain.ids += new
        chain.response += [0] * len(new)
        chain.behavior += [0.0] * len(new)
        chain.old += [0.0] * len(new)
        chain.versions += [-1] * len(new)
        chain.calls += [-1] * len(new)
        sampled = [int(i) for i in call.sampled_ids]
        position = len(chain)
        chain.members.append((index, position, len(sampled)))
        chain.ids += sampled
        chain.response += [1] * len(sampled)
        chain.behavior += [float(x) for x in call.behavior_log_probs]
        if call.old_log_probs is None:
            chain.has_old = False
            chain.old += [0.0] * len(sampled)
        else:
            chain.old += [float(x) for x in call.old_log_probs]
        chain.versions += [int(call.version)] * len(sampled)
        chain.calls += [index] * len(sampled)
        if call.routed_experts is not None:
            chain.routed.append(np.asarray(call.routed_experts))
        if call.support is not None:
            for offset, kept in enumerate(call.support):
                chain.support.append((position + offset, [int(i) for i in kept if int(i) >= 0]))
    return chains


def _trained(sessions: Sequence[Session], truncation: str) -> list[tuple[int, Session, float]]:
    trained = []
    for number, session in enumerate(sessions):
        reward = training_reward(session, truncation)
        if reward is not None:
            trained.append((number, session, reward))
    return trained


def chain_lengths(sessions: Sequence[Session], width: int, truncation: str = "mask",
                  layout: SharedPromptRows | None = None) -> list[int]:
    """The length of every chain ``pack`` would place, in order, or with a ``layout`` ``width`` for every unit (each
    takes a row); raises if a chain exceeds ``width`` or does not fit the layout."""
    check_truncation(truncation)
    chains = []
    for number, session, _ in _trained(sessions, truncation):
        for chain in chains_of(session, number):
            if len(chain) > width:
                raise ValueError(
                    f"{session.describe()} has a chain of {len(chain)} ids, longer than the row width {width}"
                )
            chains.append(chain)
    if layout is None:
        return [len(chain) for chain in chains]
    return [width for _ in _units(chains, sessions, layout)]


def fitted_layout(sessions: Sequence[Session], layout: SharedPromptRows, truncation: str = "mask"
                  ) -> SharedPromptRows:
    """The narrowest of ``layout``'s rows (:meth:`SharedPromptRows.narrower`: fewer or shorter slots) that holds
    these sessions' chains in no more rows than ``layout`` does: the layout to ``pack`` them in for a batch of fewer
    ids."""
    check_truncation(truncation)
    chains = [chain for number, session, _ in _trained(sessions, truncation) for chain in chains_of(session, number)]
    rows = len(_units(chains, sessions, layout))
    for narrower in layout.narrower()[:-1]:  # the last is layout itself
        try:
            if len(_units(chains, sessions, narrower)) <= rows:
                return narrower
        except _TooLong:  # a chain longer than this layout's slots: try wider ones
            continue
    return layout


class _TooLong(ValueError):
    """A chain that no slot of the layout can hold."""


@dataclasses.dataclass
class _Unit:
    """What pack places in one piece: one chain, or (with a layout) a prompt and the chains that continue it."""

    chains: list  # indices into the chains, in order
    shared: int = 0  # ids of the shared prompt segment (the first prompt but its last id); 0 without one
    places: list = dataclasses.field(default_factory=list)  # with a layout: each chain's (slot, offset in the slot)
    filled: list = dataclasses.field(default_factory=list)  # with a layout: the ids each slot holds so far


def _units(chains: Sequence[Chain], sessions: Sequence[Session], layout: SharedPromptRows | None) -> list[_Unit]:
    """The chains grouped into units (see the module docstring), in order; raises for a chain the layout cannot
    hold."""
    if layout is None:
        return [_Unit([index]) for index in range(len(chains))]
    units: list[_Unit] = []
    group: list[int] = []  # consecutive chains that continue one prompt of one group
    group_shared, last = 0, None
    for index, chain in enumerate(chains):
        prompt = chain.members[0][1]  # the ids of the chain's first prompt
        key = (sessions[chain.session].key, tuple(chain.ids[:prompt]))
        shared = max(prompt - 1, 0)
        if shared > layout.prompt:
            shared = 0  # too long to share: the chain alone in a slot, if it fits one
        if len(chain) - shared > layout.length:
            raise _TooLong(f"{sessions[chain.session].describe()} has a chain of {len(chain)} ids ({shared} of them "
                           f"in a shared prompt), which a slot of {layout.length} ids cannot hold")
        if not (shared and last == key):
            units += _slotted(group, group_shared, chains, layout)
            group, group_shared = [], shared
        group.append(index)
        last = key if shared else None
    return units + _slotted(group, group_shared, chains, layout)


def _slotted(group: list[int], shared: int, chains: Sequence[Chain], layout: SharedPromptRows) -> list[_Unit]:
    """Rows for chains that continue one prompt (``group``, ``shared`` of its ids in the prompt segment; 0: a chain
    alone in a row): the longest first, each in the first slot of a row with room left for it, a new slot opened
    where none has (a new row, the prompt again, where a row has all its slots)."""
    units: list[_Unit] = []
    for index in sorted(group, key=lambda i: len(chains[i]), reverse=True):  # stable: ties keep their order
        need = len(chains[index]) - shared
        home = next(((unit, slot) for unit in units for slot, used in enumerate(unit.filled)
                     if used + need <= layout.length), None)
        if home is None:
            unit = next((unit for unit in units if len(unit.filled) < layout.continuations), None) if shared else None
            if unit is None:
                unit = _Unit([], shared)
                units.append(unit)
            unit.filled.append(0)
            home = (unit, len(unit.filled) - 1)
        unit, slot = home
        unit.chains.append(index)
        unit.places.append((slot, unit.filled[slot]))
        unit.filled[slot] += need
    for unit in units:  # segments numbered in the chains' order
        order = sorted(range(len(unit.chains)), key=lambda k: unit.chains[k])
        unit.chains, unit.places = [unit.chains[k] for k in order], [unit.places[k] for k in order]
    return units


def _first_fit(lengths: Sequence[int], width: int) -> list[tuple[int, int]]:
    """(row, offset) of each length, each placed in the first row with room."""
    free: list[int] = []
    places = []
    for length in lengths:
        for row, room in enumerate(free):
            if room >= length:
                places.append((row, width - room))
                free[row] -= length
                break
        else:
            places.append((len(free), 0))
            free.append(width - length)
    return places


def rows_needed(lengths: Sequence[int], width: int) -> int:
    """How many rows first-fit packing of ``lengths`` into rows of ``width`` fills."""
    places = _first_fit(lengths, width)
    return 1 + max((row for row, _ in places), default=-1)


# ----- advantages -----------------------------------------------------------------------------


def session_advantages(rewards: Sequence[float], keys: Sequence[Any], estimator: str) -> np.ndarray:
    """Group-relative advantages of trained sessions, grouped by key (verl's outcome estimators)."""
    if not rewards:
        return np.zeros(0, np.float32)
    index = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    groups = np.array([index[key] for key in keys], np.int32)
    return np.asarray(group_advantages(np.asarray(rewards, np.float32), groups, estimator), np.float32)


# ----- pack -----------------------------------------------------------------------------------


def pack(
    sessions: Sequence[Session],
    width: int,
    rows: int | None = None,
    estimator: str = "group",
    truncation: str = "mask",
    support_capacity: int | None = None,
    layout: SharedPromptRows | None = None,
) -> dict[str, np.ndarray]:
    """Pack sessions into one ``[rows, width]`` training batch.

    COMPLETED and AGENT_ERROR sessions train on their reward; INFRA_ERROR and CANCELLED
    ones take no rows and no part in the baseline; ``truncation`` decides TRUNCATED ones
    ("mask": like an infrastructure failure, "score": on their reward, "zero": on
    reward 0). Advantages are group-relative over (task, group) with ``estimator``.

    Each session's calls become chains (call k + 1 joins call k's chain only when its
    prompt starts with every id of the chain so far, sampled ids included); chains are
    placed first-fit, in order. ``rows=None`` uses as many rows as needed; a given
    ``rows`` that is too few raises. Columns, all aligned with ``input_ids``:

    - ``input_ids``, ``text_segment_ids`` (1, 2, ... per chain in its row, 0 padding),
      ``text_positions`` (position within the chain): int32;
    - ``response_mask``: 1 on sampled ids (EOS included), int32;
    - ``behavior_log_probs``, and ``old_log_probs`` when every call recorded raw
      log-probabilities: float32, 0 off sampled ids;
    - ``versions``, ``session_index`` (the session's position in ``sessions``),
      ``call_index``: int32 on sampled ids, -1 elsewhere;
    - ``advantages``: the session's advantage across its whole chain, float32;
    - ``session_weights``: 1 / (the session's sampled ids) on its sampled ids, so a
      session mean is ``sum(loss * session_weights) / sessions``;
    - with router records: ``routed_experts`` [rows, width, layers, top_k] in the
      records' dtype and ``routed`` (bool, where a record covers the id);
    - with supports: ``support_ids`` and ``support_columns`` [rows, support_capacity],
      each row's kept ids back to back tagged with their sampled id's column, -1 padding;
    - with a ``layout``: ``text_prefix_segments``, int32, the segment of the same row an id
      also attends to in full (a group's shared prompt, see the module docstring), 0 for none;
      ``width`` must be the layout's.
    """
    check_options(estimator, truncation)
    integer("width", width, at_least=2)
    trained = _trained(sessions, truncation)
    advantages = session_advantages([r for _, _, r in trained], [s.key for _, s, _ in trained], estimator)
    chains, chain_advantage = [], []
    for (number, session, _), advantage in zip(trained, advantages, strict=True):
        for chain in chains_of(session, number):
            if len(chain) > width:
                raise ValueError(
                    f"{session.describe()} has a chain of {len(chain)} ids, longer than the row width {width}"
                )
            chains.append(chain)
            chain_advantage.append(float(advantage))
    if layout is not None and width != layout.width:
        raise ValueError(f"width {width} is not the shared-prompt layout's width {layout.width}")
    units = _units(chains, sessions, layout)
    if layout is None:
        places = _first_fit([len(chains[unit.chains[0]]) for unit in units], width)
    else:  # a row each, the prompt in its first ids
        places = [(row, 0) for row in range(len(units))]
    needed = 1 + max((row for row, _ in places), default=-1)
    if rows is None:
        rows = max(needed, 1)
    elif positive_int("rows", rows, why="or None") < needed:
        raise ValueError(f"the {len(chains)} chains need {needed} rows of width {width}; rows={rows} is too few")

    shape = (rows, width)
    batch = {
        "input_ids": np.zeros(shape, np.int32),
        "text_segment_ids": np.zeros(shape, np.int32),
        "text_positions": np.zeros(shape, np.int32),
        "response_mask": np.zeros(shape, np.int32),
        "behavior_log_probs": np.zeros(shape, np.float32),
        "versions": np.full(shape, -1, np.int32),
        "session_index": np.full(shape, -1, np.int32),
        "call_index": np.full(shape, -1, np.int32),
        "advantages": np.zeros(shape, np.float32),
        "session_weights": np.zeros(shape, np.float32),
    }
    if chains and all(c.has_old for c in chains):
        batch["old_log_probs"] = np.zeros(shape, np.float32)
    if layout is not None:
        batch["text_prefix_segments"] = np.zeros(shape, np.int32)
    sampled_per_session: dict[int, int] = {}
    for chain in chains:
        sampled_per_session[chain.session] = sampled_per_session.get(chain.session, 0) + sum(chain.response)
    segments_in_row = [0] * rows
    routed = [(c, r) for c in chains for r in c.routed]
    if routed:
        layers_top_k = {r.shape[1:] for _, r in routed}
        dtypes = {r.dtype for _, r in routed}
        if len(layers_top_k) > 1 or len(dtypes) > 1:
            raise ValueError(f"routed_experts records disagree: shapes {sorted(layers_top_k)}, dtypes {sorted(map(str, dtypes))}")
        batch["routed_experts"] = np.zeros((*shape, *layers_top_k.pop()), dtypes.pop())
        batch["routed"] = np.zeros(shape, bool)
    supported = any(c.support for c in chains)
    if supported:
        positive_int("support_capacity", support_capacity,
                     why="calls recorded a support; top-k times the sampled ids a row holds")
        batch["support_ids"] = np.full((rows, support_capacity), -1, np.int32)
        batch["support_columns"] = np.full((rows, support_capacity), -1, np.int32)
        support_used = [0] * rows

    for unit, (row, start) in zip(units, places, strict=True):
        prefix_segment = 0
        if unit.shared:  # the group's prompt, once: attended to by every chain of the unit, predicted by none
            segments_in_row[row] += 1
            prefix_segment = segments_in_row[row]
            first = chains[unit.chains[0]]
            span = slice(start, start + unit.shared)
            batch["input_ids"][row, span] = first.ids[:unit.shared]
            batch["text_segment_ids"][row, span] = prefix_segment
            batch["text_positions"][row, span] = np.arange(unit.shared)
        for index, place in zip(unit.chains, unit.places or [None], strict=True):
            offset = start if layout is None else layout.prompt + place[0] * layout.length + place[1]
            chain, advantage = chains[index], chain_advantage[index]
            skip = unit.shared  # the chain's ids before this segment live in the prefix segment
            length = len(chain) - skip
            span = slice(offset, offset + length)
            segments_in_row[row] += 1
            response = np.asarray(chain.response[skip:], np.int32)
            batch["input_ids"][row, span] = chain.ids[skip:]
            batch["text_segment_ids"][row, span] = segments_in_row[row]
            batch["text_positions"][row, span] = np.arange(skip, len(chain))
            if layout is not None:
                batch["text_prefix_segments"][row, span] = prefix_segment
            batch["response_mask"][row, span] = response
            batch["behavior_log_probs"][row, span] = chain.behavior[skip:]
            if "old_log_probs" in batch:
                batch["old_log_probs"][row, span] = chain.old[skip:]
            batch["versions"][row, span] = chain.versions[skip:]
            batch["call_index"][row, span] = chain.calls[skip:]
            batch["session_index"][row, span] = np.where(response == 1, chain.session, -1)
            batch["advantages"][row, span] = advantage
            batch["session_weights"][row, span] = response / sampled_per_session[chain.session]

            def column(position: int, offset=offset, skip=skip, start=start) -> int:
                """The column of chain position ``position`` (one in the shared prompt lives in its segment)."""
                return start + position if position < skip else offset + position - skip

            for record in chain.routed:  # later calls' records cover the shared prefix again; the latest wins
                covered = [column(position) for position in range(min(len(record), len(chain)))]
                batch["routed_experts"][row, covered] = record[:len(covered)]
                batch["routed"][row, covered] = True
            for position, kept in chain.support:
                used = support_used[row]
                if used + len(kept) > support_capacity:
                    raise ValueError(
                        f"row {row} needs more than support_capacity={support_capacity} support entries "
                        f"(at chain position {position} of {sessions[chain.session].describe()})"
                    )
                batch["support_ids"][row, used : used + len(kept)] = kept
                batch["support_columns"][row, used : used + len(kept)] = column(position)
                support_used[row] = used + len(kept)
    return batch
