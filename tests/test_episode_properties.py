"""Property tests (hypothesis) of session_of and pack over random turn structures, merges and truncations.

Every sampled id of a trained episode appears exactly once in the batch, with its own
likelihoods; no observation or prompt id carries loss mass; masked episodes carry none at
all; and every chain sits in its own segment with positions from 0, never seeing
another chain's ids.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dew.records.episode_records import ActionRecord, EpisodeRecord, session_of
from dew.records.episode_protocol import Action, Episode, EpisodeId, EpisodeStatus, Observation, Transition
from dew.records.session_packing import pack, strict_chains

IDS = st.integers(0, 50)
LOG_PROB = st.floats(-10.0, 0.0, allow_nan=False, width=32)


@st.composite
def episodes(draw, task: int, sample: int):
    context = tuple(draw(st.lists(IDS, min_size=1, max_size=4)))
    episode = Episode(EpisodeId(task, 0, sample, 0), Observation(context))
    actions = []
    for turn in range(draw(st.integers(1, 4))):
        tokens = tuple(draw(st.lists(IDS, min_size=1, max_size=3)))
        action = Action(context, tokens, draw(st.booleans()), policy_step=draw(st.integers(0, 3)))
        actions.append(ActionRecord(action, draw(st.lists(LOG_PROB, min_size=len(tokens), max_size=len(tokens))),
                                    draw(st.lists(LOG_PROB, min_size=len(tokens), max_size=len(tokens)))))
        kind = draw(st.sampled_from(["extend", "new", "completed", "truncated"]))
        if kind == "extend":  # the tool's result appended: the next call continues the chain
            observation = Observation(context + tokens + tuple(draw(st.lists(IDS, max_size=3))))
        elif kind == "new":  # a rewritten context: a new chain
            observation = Observation(tuple(draw(st.lists(IDS, min_size=1, max_size=5))))
        else:
            observation = Observation((), EpisodeStatus(kind))
        episode.transitions.append(Transition(action, observation))
        if observation.terminal:
            break
        context = observation.context
    truncated = "" if episode.last.terminal else draw(st.sampled_from(["", "a host limit"]))
    record = EpisodeRecord(episode, actions, reward=draw(st.floats(-1, 1)), group=task, truncated=truncated)
    if record.status is EpisodeStatus.RUNNING:
        record.truncated = "max_turns"
    return record


@st.composite
def cohorts(draw):
    return [draw(episodes(task, sample)) for task in range(draw(st.integers(1, 2))) for sample in range(2)]


@settings(max_examples=300, deadline=None)
@given(cohorts())
def test_sampled_ids_appear_once_with_their_likelihoods_and_chains_stay_apart(records):
    sessions = [session_of(record) for record in records]
    width = 40
    batch = pack(sessions, width, rows=sum(len(strict_chains(s)) for s in sessions) + 1, truncation="mask")
    mask = batch["response_mask"] != 0
    trained = [i for i, r in enumerate(records) if r.status is EpisodeStatus.COMPLETED]
    for index, (record, session) in enumerate(zip(records, sessions)):
        mine = batch["session_index"] == index
        if index not in trained:
            assert not (mine & mask).any()  # a truncated episode is masked whole
            continue
        for call, kept in enumerate(record.actions):
            where = mine & (batch["call_index"] == call) & mask
            assert batch["input_ids"][where].tolist() == list(kept.action.tokens)  # exactly once, in order
            np.testing.assert_array_equal(batch["behavior_log_probs"][where],
                                          np.float32(kept.behavior_log_probs))
            np.testing.assert_array_equal(batch["old_log_probs"][where], np.float32(kept.old_log_probs))
    assert mask.sum() == sum(len(a.action.tokens) for i in trained for a in records[i].actions)
    assert not batch["session_weights"][~mask].any() and not batch["behavior_log_probs"][~mask].any()
    placed = []
    for row in range(batch["input_ids"].shape[0]):
        segments = batch["text_segment_ids"][row]
        for segment in sorted(set(segments.tolist()) - {0}):
            span = np.nonzero(segments == segment)[0]
            assert (np.diff(span) == 1).all()  # contiguous
            assert batch["text_positions"][row, span].tolist() == list(range(len(span)))  # its own positions
            placed.append(batch["input_ids"][row, span].tolist())
    chains = [c.ids for i in trained for c in strict_chains(sessions[i]) if any(c.response)]
    assert sorted(placed) == sorted(chains)  # each chain whole in one segment: no chain sees another's ids
