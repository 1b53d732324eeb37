"""Sessions as verl rows and back: ``to_verl``, ``from_verl`` and ``VerlTrajectory``.

A row is one verl ``AgentLoopOutput`` as its ``model_dump()`` writes it: ``prompt_ids``,
``response_ids``, ``response_mask`` (1 on ids the model sampled), ``response_logprobs``
(the engine's behaviour log-probabilities, 0.0 elsewhere), ``routed_experts``, the media
fields, ``reward_score``, ``num_turns``, ``metrics`` and ``extra_fields``, where verl's
fully-asynchronous rollouts keep ``min_global_steps`` and ``max_global_steps`` (the
policy versions a trajectory was drawn across). verl (0.9.1,
``verl/experimental/agent_loop/agent_loop.py``) pads these into its batch; dew packs them.

:func:`to_verl` writes one row per strict chain of each session (call k + 1 continues
the chain when its prompt starts with every id of the chain so far, as ``pack`` merges):
the first call's prompt, then every sampled and in-between id. ``extra_fields["dew"]``
holds what a row has no place for (the session's task, group, sample, attempt, status,
reward components and detail, and per call where it starts, how many ids it sampled,
its finish reason, version, raw log-probabilities, support and router record), so
:func:`from_verl` restores the sessions exactly, a call that sampled nothing included.

:func:`from_verl` reads verl's own rows too: each run of mask-1 ids is one call whose
prompt is every id before it, at the row's ``min_global_steps``, with the finish reason
``"unrecorded"`` (verl's rows do not keep it); ``samples`` (verl's ``rollout.n``) groups
rows the way verl repeats prompts, row i being sample ``i % samples`` of task
``str(i // samples)``. What verl's rows carry beyond a session comes back in
:class:`VerlTrajectory` (``extras``: verl's own extra_fields; ``fields``: num_turns,
metrics and the media fields) and ``to_verl`` writes it out unchanged. Rows with media
are refused unless ``media=True``, which imports them for a round trip only. Every
imported call passes :func:`dew.records.actions.check_call`, the validator of live and
restored actions; every refusal names the row and the field, and nothing is returned
until every row has passed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dew.records.actions import check_call, token_ids
from dew.records.session_packing import strict_chains
from dew.records.session_records import Call, Session, Status, Task
from dew.validation import positive_int

ROW_FIELDS = ("prompt_ids", "response_ids", "response_mask", "response_logprobs", "routed_experts", "multi_modal_data",
              "reward_score", "num_turns", "metrics", "extra_fields", "mm_processor_kwargs", "mm_processor_output")
MEDIA = ("multi_modal_data", "mm_processor_kwargs", "mm_processor_output")
DERIVED = ("prompt_ids", "response_ids", "response_mask", "response_logprobs", "routed_experts", "reward_score",
           "extra_fields")  # what to_verl writes from the session; a row's other fields travel in VerlTrajectory.fields
AS_DICT = ("prompts", "responses", "rollout_log_probs", "rm_scores")  # AgentLoopOutput.as_dict() names
METRICS = {"generate_sequences": 0.0, "tool_calls": 0.0, "compute_score": 0.0, "num_preempted": -1}  # verl's defaults
UNRECORDED = "unrecorded"  # the finish reason of a call read from a verl row, which does not keep one
DEW = "dew"
FORMAT = 1
ROUTED_DTYPE = "int16"  # verl's routed_experts dtype (as_dict, _agent_loop_postprocess)
UNSCORED = (Status.INFRA_ERROR, Status.CANCELLED, Status.TRUNCATED)  # statuses a session may hold without a reward


@dataclasses.dataclass(frozen=True)
class VerlTrajectory:
    """One session read from verl rows, with what those rows carried that a Session has no place for.

    ``rows``: the indices of its rows, in chain order; ``extras``: each row's own
    extra_fields, dew's entry aside; ``fields``: each row's num_turns, metrics and media
    fields as the row had them; ``missing``: the fields dew derives from a session that a
    row did not have (left out again on the way back); ``described``: whether the rows
    carried dew's entry (it is written back only then). A trajectory whose rows carry media is for a round trip
    only: ``session`` refuses it, ``to_verl`` writes it back.
    """

    imported: Session
    rows: tuple[int, ...]
    extras: tuple[Mapping[str, Any], ...]
    fields: tuple[Mapping[str, Any], ...]
    missing: tuple[tuple[str, ...], ...]
    described: bool

    @property
    def media(self) -> bool:
        return any(_has_media(fields.get(name)) for fields in self.fields for name in MEDIA)

    @property
    def session(self) -> Session:
        if self.media:
            raise ValueError(f"verl rows {list(self.rows)} carry media ({', '.join(MEDIA)}): dew's text trainer would "
                             "score their placeholder ids without the images or video, so they were imported for a "
                             "round trip only (to_verl writes them back)")
        return self.imported


# ----- writing -----------------------------------------------------------------------------------


def to_verl(sessions: Sequence[Session | VerlTrajectory]) -> list[dict[str, Any]]:
    """verl AgentLoopOutput rows (``model_dump()`` layout), one per strict chain of each session (module docstring)."""
    rows: list[dict[str, Any]] = []
    for item in sessions:
        if isinstance(item, VerlTrajectory):
            rows += _trajectory_rows(item)
        elif isinstance(item, Session):
            rows += _session_rows(item)
        else:
            raise TypeError(f"to_verl takes Session or VerlTrajectory records, got {type(item).__name__}")
    return rows


def _session_rows(session: Session) -> list[dict[str, Any]]:
    where = session.describe()
    if not session.calls:
        raise ValueError(f"{where} has no calls; a verl row holds the ids of at least one model call")
    if not isinstance(session.status, Status):
        raise TypeError(f"{where}: status must be a Status, got {session.status!r}")
    chains = strict_chains(session)
    identity = {
        "format": FORMAT, "task": {"id": session.task.id, "data": _json_data(f"{where}: task data", session.task.data)},
        "group": session.group, "sample": session.sample, "attempt": session.attempt, "status": session.status.value,
        "reward": session.reward, "components": _json_data(f"{where}: components", session.components),
        "detail": session.detail, "chains": len(chains),
    }
    rows = []
    for number, chain in enumerate(chains):
        start = chain.members[0][1]
        calls = [session.calls[index] for index, _, _ in chain.members]
        described = []
        for (index, position, count), call in zip(chain.members, calls, strict=True):
            entry = {"index": index, "start": position, "sampled": count, "finish_reason": call.finish_reason,
                     "version": int(call.version)}
            if call.old_log_probs is not None:
                entry["old_log_probs"] = [float(x) for x in call.old_log_probs]
            if call.support is not None:
                entry["support"] = [[int(i) for i in kept] for kept in call.support]
            described.append(entry)
        routed = _row_routing(chain.members, calls, described)
        versions = [entry["version"] for entry in described]
        rows.append({
            "prompt_ids": chain.ids[:start], "response_ids": chain.ids[start:],
            "response_mask": chain.response[start:], "response_logprobs": chain.behavior[start:],
            "routed_experts": None if routed is None else routed.tolist(), "multi_modal_data": None,
            "reward_score": None if session.reward is None else float(session.reward), "num_turns": 2 * len(calls),
            "metrics": dict(METRICS),
            "extra_fields": {"min_global_steps": min(versions), "max_global_steps": max(versions),
                             DEW: {**identity, "chain": number, "calls": described}},
            "mm_processor_kwargs": None, "mm_processor_output": None,
        })
    return rows


def _row_routing(members, calls: list[Call], described: list[dict]) -> np.ndarray | None:
    """The row's router record (each call's over the ids it read and drew, the latest winning, as pack places them)
    when every call recorded one and some cover an id; a call's own record goes in dew's entry where the row's does
    not reproduce it."""
    records = [None if call.routed_experts is None else np.asarray(call.routed_experts) for call in calls]
    if all(record is None for record in records):
        return None
    merged = None
    if all(record is not None for record in records) and max(len(record) for record in records):
        length = max(len(record) for record in records)
        merged = np.zeros((length, *records[0].shape[1:]), records[0].dtype)
        for record in records:
            merged[: len(record)] = record
    for record, entry in zip(records, described, strict=True):
        if record is None:
            continue
        entry["routed"] = len(record)
        entry["routed_dtype"] = str(record.dtype)
        if merged is None or merged.dtype != record.dtype or not np.array_equal(merged[: len(record)], record):
            entry["routed_experts"] = record.tolist()
            entry["routed_shape"] = list(record.shape)  # an empty record's layers and top_k survive JSON
    return merged


def _trajectory_rows(trajectory: VerlTrajectory) -> list[dict[str, Any]]:
    rows = _session_rows(trajectory.imported)
    if len(rows) != len(trajectory.extras) or len(rows) != len(trajectory.fields):
        raise ValueError(f"verl rows {list(trajectory.rows)}: the session makes {len(rows)} chains but the trajectory "
                         f"keeps {len(trajectory.extras)} rows' extra_fields")
    out = []
    for row, extras, fields, missing in zip(rows, trajectory.extras, trajectory.fields, trajectory.missing, strict=True):
        ours = row["extra_fields"]
        extra = dict(extras)
        for name in ("min_global_steps", "max_global_steps"):  # a row's own versions are kept
            if name not in extras:
                extra[name] = ours[name]
        if trajectory.described:
            extra[DEW] = ours[DEW]
        written = {name: row[name] for name in DERIVED if name not in missing}
        written.update(fields)
        written["extra_fields"] = extra
        out.append(written)
    return out


def _json_data(where: str, value):
    """``value`` when JSON carries it unchanged (dew's entry must restore it exactly)."""
    try:
        same = json.loads(json.dumps(value)) == value
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where} cannot be written into a verl row's extra_fields ({error}); use JSON values") from None
    if not same:
        raise ValueError(f"{where} does not survive JSON unchanged (tuples, non-string keys or NaN): {value!r}")
    return value


# ----- reading -----------------------------------------------------------------------------------


def from_verl(rows: Sequence[Mapping[str, Any]], samples: int | None = None, media: bool = False
              ) -> list[VerlTrajectory]:
    """Sessions from verl AgentLoopOutput rows (dicts or the models themselves; see the module docstring)."""
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence):
        raise TypeError(f"from_verl takes a sequence of verl rows, got {type(rows).__name__}")
    samples = 1 if samples is None else positive_int("samples", samples, why="verl's rollout.n, or None")
    read = [_read_row(index, row, media) for index, row in enumerate(rows)]
    native = [r for r in read if r["dew"] is None]
    if native and len(rows) % samples:
        raise ValueError(f"{len(rows)} verl rows do not split into groups of samples={samples} (verl's rollout.n)")
    grouped: dict[Any, list[dict]] = {}
    for row in read:
        dew = row["dew"]
        key = (row["index"],) if dew is None else ("dew", dew["task"]["id"], dew["group"], dew["sample"], dew["attempt"])
        grouped.setdefault(key, []).append(row)
    return [_trajectory(parts, samples) for parts in grouped.values()]


def _read_row(index: int, row, media: bool) -> dict[str, Any]:
    where = f"verl row {index}"
    if hasattr(row, "model_dump") and not isinstance(row, Mapping):
        row = row.model_dump()
    if not isinstance(row, Mapping):
        raise TypeError(f"{where} must be a mapping of AgentLoopOutput fields, got {type(row).__name__}")
    for name in row:
        if name in AS_DICT:
            raise ValueError(f"{where}: field {name!r} is AgentLoopOutput.as_dict()'s; pass the rows as model_dump() "
                             "writes them (prompt_ids, response_ids, response_mask, response_logprobs, ...)")
        if name not in ROW_FIELDS:
            raise ValueError(f"{where}: field {name!r} is not an AgentLoopOutput field ({', '.join(ROW_FIELDS)})")
    for name in ("prompt_ids", "response_ids", "response_mask"):
        if name not in row:
            raise ValueError(f"{where}: field {name!r} is missing")
    if not media:
        for name in MEDIA:
            if _has_media(row.get(name)):
                raise ValueError(f"{where}: field {name!r} carries media; dew's text trainer would score the row's "
                                 "placeholder ids without the images or video (from_verl(rows, media=True) imports it "
                                 "for a round trip only)")
    prompt = token_ids(f"{where}: prompt_ids", _listed(row["prompt_ids"]), nonempty=True)
    response = token_ids(f"{where}: response_ids", _listed(row["response_ids"]))
    mask = token_ids(f"{where}: response_mask", _listed(row["response_mask"]))
    if len(mask) != len(response) or any(m not in (0, 1) for m in mask):
        raise ValueError(f"{where}: response_mask must be one 0 or 1 per response id ({len(response)}), got "
                         f"{len(mask)} values {sorted(set(mask))}")
    logprobs = row.get("response_logprobs")
    if logprobs is None:
        raise ValueError(f"{where}: field 'response_logprobs' is missing; dew trains on the engine's behaviour "
                         "log-probabilities (set rollout.calculate_log_probs in verl)")
    logprobs = _numbers(f"{where}: response_logprobs", logprobs, len(response))
    extra = row.get("extra_fields") or {}
    if not isinstance(extra, Mapping):
        raise ValueError(f"{where}: extra_fields must be a mapping, got {type(extra).__name__}")
    dew = extra.get(DEW)
    if dew is not None and not isinstance(dew, Mapping):
        raise ValueError(f"{where}: extra_fields.dew must be a mapping, got {type(dew).__name__}")
    reward = row.get("reward_score")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)
                               or not math.isfinite(reward)):
        raise ValueError(f"{where}: reward_score must be a finite number, got {reward!r}")
    ids = list(prompt) + list(response)
    full_mask = [0] * len(prompt) + list(mask)
    behavior = [0.0] * len(prompt) + list(logprobs)
    routed = _routing(where, row.get("routed_experts"), len(ids))
    read = {"index": index, "where": where, "row": row, "extra": extra, "dew": dew, "reward": reward}
    read["calls"] = (_described_calls(where, dew, ids, full_mask, behavior, routed) if dew is not None
                     else _native_calls(where, extra, ids, full_mask, behavior, routed))
    if reward is None and not (dew is not None and _status(where, dew) in UNSCORED):
        raise ValueError(f"{where}: field 'reward_score' is missing; a row trains on its reward")
    for number, (_, call) in enumerate(read["calls"]):
        check_call(f"{where}, call {number}", call)
    return read


def _native_calls(where, extra, ids, mask, behavior, routed) -> list[tuple[int, Call]]:
    version = extra.get("min_global_steps")
    if version is None or isinstance(version, bool) or not isinstance(version, numbers.Integral):
        raise ValueError(f"{where}: extra_fields.min_global_steps must be the integer policy version the row was drawn "
                         f"under, got {version!r}")
    runs, start = [], None
    for position, flag in enumerate(mask + [0]):
        if flag and start is None:
            start = position
        elif not flag and start is not None:
            runs.append((start, position))
            start = None
    if not runs:  # nothing sampled: one call that read every id
        runs = [(len(ids), len(ids))]
    if routed is not None and len(routed) > runs[-1][1]:
        raise ValueError(f"{where}: routed_experts covers {len(routed)} ids but the row's last sampled id ends at "
                         f"{runs[-1][1]}; no call read the rest")
    calls = []
    for number, (begin, end) in enumerate(runs):
        record = None if routed is None else routed[: min(len(routed), end)]
        calls.append((number, Call(prompt_ids=ids[:begin], sampled_ids=ids[begin:end],
                                   behavior_log_probs=behavior[begin:end], finish_reason=UNRECORDED,
                                   version=int(version), routed_experts=record)))
    return calls


def _described_calls(where, dew, ids, mask, behavior, routed) -> list[tuple[int, Call]]:
    if dew.get("format") != FORMAT:
        raise ValueError(f"{where}: extra_fields.dew.format is {dew.get('format')!r}; this dew reads format {FORMAT}")
    entries = dew.get("calls")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: extra_fields.dew.calls must be a non-empty list of the row's calls")
    expected = [0] * len(ids)
    calls, last = [], 0
    for entry in entries:
        field = f"{where}: extra_fields.dew.calls[{len(calls)}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{field} must be a mapping, got {type(entry).__name__}")
        try:
            index, begin, count, version = (int(entry[k]) for k in ("index", "start", "sampled", "version"))
            reason = entry["finish_reason"]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{field} needs integer index, start, sampled and version and a finish_reason "
                             f"({error!r})") from None
        if not last <= begin <= begin + count <= len(ids) or begin == 0:
            raise ValueError(f"{field}: start {begin} and sampled {count} do not lie after the previous call "
                             f"within the row's {len(ids)} ids")
        last = begin + count
        expected[begin:last] = [1] * count
        record = entry.get("routed_experts")
        if record is not None:
            record = np.asarray(record, entry.get("routed_dtype", ROUTED_DTYPE))
            if "routed_shape" in entry:
                record = record.reshape(entry["routed_shape"])
        elif entry.get("routed") is not None:
            if routed is None or int(entry["routed"]) > len(routed):
                raise ValueError(f"{field}: routed {entry['routed']} needs the row's routed_experts to cover as many ids")
            record = routed[: int(entry["routed"])].astype(entry.get("routed_dtype", ROUTED_DTYPE))
        calls.append((index, Call(
            prompt_ids=ids[:begin], sampled_ids=ids[begin:last], behavior_log_probs=behavior[begin:last],
            finish_reason=reason, version=version, old_log_probs=entry.get("old_log_probs"),
            routed_experts=record, support=entry.get("support"))))
    if expected != mask:
        raise ValueError(f"{where}: extra_fields.dew.calls do not match response_mask (the sampled spans they give "
                         "are not the mask's ones)")
    return calls


def _routing(where: str, value, total: int) -> np.ndarray | None:
    if value is None:
        return None
    array = np.asarray(value)
    if array.ndim != 3 or len(array) > total or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"{where}: routed_experts must be integer [ids <= {total}, layers, top_k], got shape "
                         f"{array.shape} dtype {array.dtype}")
    if isinstance(value, np.ndarray):
        return value
    limits = np.iinfo(ROUTED_DTYPE)
    if array.size and (array.min() < limits.min or array.max() > limits.max):
        raise ValueError(f"{where}: routed_experts holds expert ids outside {ROUTED_DTYPE}, verl's dtype")
    return array.astype(ROUTED_DTYPE)


def _status(where: str, dew: Mapping) -> Status:
    try:
        return Status(dew.get("status"))
    except ValueError:
        raise ValueError(f"{where}: extra_fields.dew.status must be one of {[s.value for s in Status]}, got "
                         f"{dew.get('status')!r}") from None


def _trajectory(parts: list[dict], samples: int) -> VerlTrajectory:
    first = parts[0]
    dew = first["dew"]
    if dew is None:
        index = first["index"]
        session = Session(task=Task(str(index // samples)), group=0, sample=index % samples, attempt=0,
                          calls=[call for _, call in first["calls"]], status=Status.COMPLETED,
                          reward=float(first["reward"]))
    else:
        session = _described_session(parts)
    extras = tuple({k: v for k, v in part["extra"].items() if k != DEW} for part in parts)
    fields = tuple({k: v for k, v in part["row"].items() if k not in DERIVED} for part in parts)
    missing = tuple(tuple(name for name in DERIVED if name != "extra_fields" and name not in part["row"])
                    for part in parts)
    return VerlTrajectory(imported=session, rows=tuple(part["index"] for part in parts), extras=extras,
                          fields=fields, missing=missing, described=dew is not None)


def _described_session(parts: list[dict]) -> Session:
    first = parts[0]
    dew, where = first["dew"], first["where"]
    chains = dew.get("chains")
    numbers_seen = sorted(part["dew"].get("chain") for part in parts)
    if numbers_seen != list(range(len(parts))) or chains != len(parts):
        raise ValueError(f"{where}: extra_fields.dew gives chains {numbers_seen} of {chains} for this session, but "
                         f"rows {[p['index'] for p in parts]} are all there are; every chain's row is needed")
    for part in parts[1:]:
        for name in ("task", "status", "reward", "components", "detail"):
            if part["dew"].get(name) != dew.get(name):
                raise ValueError(f"{part['where']}: extra_fields.dew.{name} disagrees with row {first['index']} of "
                                 "the same session")
    parts = sorted(parts, key=lambda part: part["dew"]["chain"])
    calls = sorted((pair for part in parts for pair in part["calls"]), key=lambda pair: pair[0])
    if [index for index, _ in calls] != list(range(len(calls))):
        raise ValueError(f"{where}: extra_fields.dew.calls index the session's calls {[i for i, _ in calls]}, not "
                         f"0..{len(calls) - 1}")
    task = dew.get("task")
    if not isinstance(task, Mapping) or not isinstance(task.get("id"), str):
        raise ValueError(f"{where}: extra_fields.dew.task must hold the task's string id and its data")
    reward = dew.get("reward")
    if reward != first["reward"]:
        raise ValueError(f"{where}: reward_score {first['reward']!r} disagrees with extra_fields.dew.reward {reward!r}")
    try:
        return Session(task=Task(task["id"], task.get("data") or {}), group=int(dew["group"]),
                       sample=int(dew["sample"]), attempt=int(dew["attempt"]), calls=[call for _, call in calls],
                       status=_status(where, dew), reward=reward, components=dew.get("components") or {},
                       detail=dew.get("detail", ""))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{where}: extra_fields.dew needs integer group, sample and attempt ({error!r})") from None


def _has_media(value) -> bool:
    if value is None:
        return False
    if isinstance(value, (Mapping, list, tuple)):
        return len(value) > 0
    return True


def _listed(values):
    return values.tolist() if isinstance(values, np.ndarray) else values


def _numbers(where: str, values, count: int) -> list[float]:
    values = _listed(values)
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) != count:
        got = f"{len(values)} values" if isinstance(values, Sequence) else type(values).__name__
        raise ValueError(f"{where} must hold one number per response id ({count}), got {got}")
    for position, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"{where}[{position}] must be a finite number, got {value!r}")
    return [float(v) for v in values]
