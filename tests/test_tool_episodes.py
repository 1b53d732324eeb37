"""EpisodeRollout: a policy that calls a square tool, receives the result and answers; lifecycle and numbers.

``ToolPolicy``, ``Harness``, ``verify`` and ``SAMPLING`` are the fixtures the spec's PPO
example imports. The task: task t asks for the square of n = t % 3 + 1 (context
``[NUM(n)]``); the policy may call the tool (``[SQUARE, EOS]``), which answers with
``[RESULT, NUM(n * n)]`` appended to the context (a second call ends the episode
unanswered), then answer ``[NUM(x), EOS]``;
``verify`` gives 1 for the right square. ToolPolicy is a one-layer causal transformer
over this 16-id vocabulary whose logits carry a fixed bias towards EOS, so actions stay
short (masked truncations would otherwise let training escape negative advantages) (the spec describes a bigram policy; a bigram cannot copy
the tool's result from two ids back, and any small decoder TextGeneration drives serves).
"""

import asyncio
import concurrent.futures
import itertools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ScriptedPolicy

from dew import Trainer
from dew.collection.episode_rollout import EpisodeCancelled, EpisodeFailure
from dew.data import Dataset
from dew.inference import Draw, DrawFuture, RolloutServer, TextGeneration
from dew.models.transformer import CausalTransformer
from dew.collection.episode_rollout import EpisodeRollout
from dew.objectives.grpo import GRPOObjective
from dew.records.episode_records import session_of
from dew.records.episode_protocol import Environment, EpisodeStatus, Observation
from dew.records.session_records import Status, Task
from dew.sampling import Sampling

PAD, EOS, SQUARE, RESULT = 0, 1, 2, 3
VOCAB = 16
SAMPLING = Sampling(eos_id=EOS, temperature=1.0)


def NUM(n: int) -> int:
    return 4 + n


class EOSLeaning(CausalTransformer):
    """A causal transformer whose logits carry a fixed bias towards EOS: actions stay short."""

    eos_bias: float = 3.0

    @nn.compact
    def __call__(self, tokens, *args, hidden=False, **kwargs):
        out = super().__call__(tokens, *args, hidden=hidden, **kwargs)
        if hidden:
            return out
        bias = jnp.zeros(self.vocab_size).at[EOS].set(self.eos_bias)  # fixed, so training cannot unlearn EOS
        return (out[0] + bias, out[1]) if isinstance(out, tuple) else out + bias


def ToolPolicy():
    """The square task's policy: a one-layer decoder over the 16 ids, leaning to EOS (about 57% at the start)."""
    return EOSLeaning(vocab_size=VOCAB, emb_features=16, num_layers=1, num_heads=2, mlp_features=32, max_seq_len=16)


class SquareEnvironment(Environment):
    """One episode of the square task; keeps an audit of what happened to it."""

    def __init__(self, identity, audit: list, fail_on_step=None, step_error=None, observation=None):
        self.identity, self.audit = identity, audit
        self.n = identity.task % 3 + 1
        self.fail_on_step, self.step_error, self.observation = fail_on_step, step_error, observation
        self.steps = 0
        self.closed = False
        self.exit_error = None

    def __exit__(self, *exc_info):
        self.exit_error = exc_info[1]
        super().__exit__(*exc_info)

    def reset(self):
        return Observation((NUM(self.n),))

    def step(self, action):
        self.steps += 1
        self.audit.append(("step", self.identity.task, self.identity.sample, action.tokens))
        if self.fail_on_step == self.steps:
            raise self.step_error
        if self.observation is not None:
            return self.observation
        said = action.tokens[:-1]
        if said == (SQUARE,) and RESULT in action.context:  # the result is already there: the episode ends, unanswered
            return Observation((), EpisodeStatus.COMPLETED, "called the tool again")
        if said == (SQUARE,):
            return Observation(action.context + action.tokens + (RESULT, NUM(self.n * self.n)))
        return Observation((), EpisodeStatus.COMPLETED, f"answered {said}")

    def close(self):
        self.closed = True
        self.audit.append(("close", self.identity.task, self.identity.sample))

    def get_state(self) -> bytes:
        return json.dumps({"steps": self.steps}).encode()

    def set_state(self, state: bytes) -> None:
        self.steps = json.loads(state)["steps"]
        self.audit.append(("restored", self.identity.task, self.identity.sample, self.steps))


class Harness:
    """The environment factory: one SquareEnvironment per EpisodeId, all of them kept for the checks."""

    def __init__(self, **failure):
        self.failure = failure
        self.audit: list = []
        self.opened: list[SquareEnvironment] = []

    def __call__(self, identity):
        failure = self.failure if identity.sample == 1 and identity.task == 0 else {}
        env = SquareEnvironment(identity, self.audit, **failure)
        self.opened.append(env)
        return env


def verify(episode) -> float:
    """1 when the last action answers the square of the task's number."""
    n = episode.id.task % 3 + 1
    last = episode.transitions[-1].action.tokens if episode.transitions else ()
    return float(last[:-1] == (NUM(n * n),) and episode.status is EpisodeStatus.COMPLETED)


class Scripted(ScriptedPolicy):
    """Replies ``turns(n, context)`` (n: the task's number) then EOS."""

    def __init__(self, turns, eos=True):
        super().__init__(lambda context: turns(context[0] - 4, context), EOS, eos=eos)


def square_then_answer(n, context):
    return [SQUARE] if context[-2:-1] != (RESULT,) and RESULT not in context else [NUM(n * n)]


def rollout(policy, harness=None, **options):
    settings = {"max_prompt_tokens": 8, "max_new_tokens": 3, "max_turns": 3, "groups": 2, "sampling": SAMPLING}
    return EpisodeRollout(policy, harness or Harness(), verify, **{**settings, **options})


def tasks(*ids):
    return {"task_id": np.array(ids, np.int32)}


def test_an_episode_calls_the_tool_receives_the_square_and_answers():
    harness = Harness()
    collector = rollout(Scripted(square_then_answer), harness)
    records = collector.collect(tasks(1, 2), None, 3, jax.random.key(0))
    assert [(r.episode.id.task, r.episode.id.sample, r.group) for r in records] == [(1, 0, 0), (1, 1, 0), (2, 0, 1),
                                                                                    (2, 1, 1)]
    first = records[0]
    assert first.reward == 1.0 and first.status is EpisodeStatus.COMPLETED
    (call, answer) = first.episode.transitions
    assert call.action.context == (NUM(2),) and call.action.tokens == (SQUARE, EOS) and call.action.policy_step == 3
    assert call.observation.context == (NUM(2), SQUARE, EOS, RESULT, NUM(4))  # the tool's result extends the context
    assert answer.action.tokens == (NUM(4), EOS)
    assert all(env.closed and env.exit_error is None for env in harness.opened)
    session = session_of(first)
    assert [c.version for c in session.calls] == [3, 3] and session.task.id == "1"
    batch = collector.project(records)
    # one chain per episode (the answer's context holds the call and the tool's result): 6 ids, 4 of them sampled
    row = int(np.nonzero(batch["session_index"] == 0)[0][0])
    ids = batch["input_ids"][row][batch["text_segment_ids"][row] == 1].tolist()
    assert ids == [NUM(2), SQUARE, EOS, RESULT, NUM(4), NUM(4), EOS]
    mask = batch["response_mask"][row][batch["text_segment_ids"][row] == 1].tolist()
    assert mask == [0, 1, 1, 0, 0, 1, 1]  # the tool's ids carry no loss mass
    old = batch["old_log_probs"][row][batch["text_segment_ids"][row] == 1]
    np.testing.assert_allclose(old[[1, 2, 5, 6]], [-0.5, -0.51, -0.5, -0.51], rtol=1e-6)
    np.testing.assert_allclose(batch["behavior_log_probs"][row][batch["text_segment_ids"][row] == 1][[1, 2]],
                               [-0.25, -0.255], rtol=1e-6)


def test_every_round_samples_every_slot_at_its_row_with_inert_prompts_for_finished_ones():
    def answer_at_once_for_task_1(n, context):
        return [NUM(n * n)] if n == 2 else square_then_answer(n, context)

    policy = Scripted(answer_at_once_for_task_1)
    rollout(policy).collect(tasks(1, 2), None, 0, jax.random.key(0))
    assert [len(contexts) for contexts in policy.calls] == [4, 4]  # task 1's episodes ended after one turn
    assert policy.calls[1][:2] == [(0,), (0,)] and policy.calls[1][2][-2:] == (RESULT, NUM(9))


def test_limits_truncate_without_reaching_the_tool():
    harness = Harness()
    records = rollout(Scripted(lambda n, c: [SQUARE, SQUARE, SQUARE], eos=False), harness).collect(
        tasks(0), None, 0, jax.random.key(0))
    assert all(r.status is EpisodeStatus.TRUNCATED and len(r.actions) == 1 for r in records)
    assert not [entry for entry in harness.audit if entry[0] == "step"]  # a budget-hit response never reaches a tool
    # a context over max_prompt_tokens truncates before the call, keeping what was recorded
    long = rollout(Scripted(square_then_answer), max_prompt_tokens=4).collect(tasks(0), None, 0, jax.random.key(0))
    assert all(r.status is EpisodeStatus.TRUNCATED and len(r.actions) == 1 and "max_prompt_tokens=4" in r.detail
               for r in long)
    turns = rollout(Scripted(lambda n, c: [SQUARE]), max_turns=1).collect(tasks(0), None, 0, jax.random.key(0))
    assert all(len(r.actions) == 1 and "max_turns=1" in r.detail for r in turns)
    assert rollout(Scripted(lambda n, c: [SQUARE]), max_turns=1).project(turns) is None


@pytest.mark.parametrize("error, kind", [(RuntimeError("tool crashed"), EpisodeFailure),
                                         (asyncio.CancelledError(), EpisodeCancelled),
                                         (concurrent.futures.CancelledError(), EpisodeCancelled)])
def test_a_failing_or_cancelled_step_aborts_the_group_and_releases_every_environment(error, kind):
    harness = Harness(fail_on_step=1, step_error=error)
    seen = []
    with pytest.raises(kind) as caught:
        rollout(Scripted(square_then_answer), harness, record=seen.append).collect(tasks(0, 1), None, 0,
                                                                                  jax.random.key(0))
    assert caught.value.__cause__ is error
    assert caught.value.episode.episode.id.sample == 1 and caught.value.episode.episode.id.task == 0
    assert all(env.closed for env in harness.opened) and len(harness.opened) == 4
    assert all(env.exit_error is error for env in harness.opened)  # each environment exits under the original
    assert len(seen) == 4 and kind.status in (EpisodeStatus.ERROR, EpisodeStatus.CANCELLED)


def test_terminal_failures_reported_by_the_environment_abort_the_group():
    cancelled = Harness(fail_on_step=None, observation=Observation((), EpisodeStatus.CANCELLED, "stopped"))
    with pytest.raises(EpisodeCancelled, match="ended cancelled: stopped") as caught:
        rollout(Scripted(square_then_answer), cancelled).collect(tasks(0), None, 0, jax.random.key(0))
    assert caught.value.__cause__ is None  # a cancellation the environment reports has no source exception
    errored = Harness(observation=Observation((), EpisodeStatus.ERROR, "tool timed out"))
    with pytest.raises(EpisodeFailure, match="ended error: tool timed out"):
        rollout(Scripted(square_then_answer), errored).collect(tasks(0), None, 0, jax.random.key(0))
    assert all(env.closed for env in errored.opened)


def test_a_non_finite_verifier_result_fails_and_a_failed_release_throws_the_episode_out():
    with pytest.raises(EpisodeFailure, match="the verifier returned nan"):
        EpisodeRollout(Scripted(square_then_answer), Harness(), lambda episode: float("nan"), max_prompt_tokens=8,
                       max_new_tokens=3, max_turns=3, groups=2, sampling=SAMPLING).collect(
            tasks(0), None, 0, jax.random.key(0))

    class Leaky(Harness):
        def __call__(self, identity):
            env = super().__call__(identity)
            if identity.sample == 0:
                def close():
                    raise OSError("cannot remove the workspace")
                env.close = close
            return env

    records = rollout(Scripted(square_then_answer), Leaky()).collect(tasks(0, 1), None, 0, jax.random.key(0))
    assert [r.episode.id.sample for r in records] == [1, 1]  # the episodes whose release failed are gone


def test_bad_options_and_records_from_two_bindings_are_refused():
    with pytest.raises(TypeError, match="policy must be bindable"):
        rollout(object())
    with pytest.raises(ValueError, match="groups must be an integer >= 2"):
        rollout(Scripted(square_then_answer), groups=1)
    with pytest.raises(KeyError, match="needs integer 'task_id' rows"):
        rollout(Scripted(square_then_answer)).collect({"prompt": np.zeros((1, 2))}, None, 0, jax.random.key(0))
    collector = rollout(Scripted(square_then_answer))
    first = collector.collect(tasks(0), None, 0, jax.random.key(0))
    second = collector.collect(tasks(0), None, 0, jax.random.key(0))  # same clocks, a separate binding
    assert first == second  # the binding's identity is not part of a record's equality
    with pytest.raises(ValueError, match="2 of these 4 episode records come from a separately bound collection"):
        collector.project(first + second)


def trainer(output_dir=None, accumulate=1):
    model = ToolPolicy()
    objective = GRPOObjective(model, seq_len=10)
    episodes = rollout(TextGeneration(model), groups=4)
    return Trainer(objective, optax.adam(3e-2), key=jax.random.key(5), rollout=episodes, progress=False,
                   accumulate=accumulate, output_dir=output_dir, checkpoint_every=2 if output_dir else None)


def task_stream():
    return Dataset(train=lambda partition: itertools.repeat(tasks(0, 1, 2)), val=None, records=None, batch=3)


@pytest.mark.parametrize("accumulate, stop", [(1, 2), (2, 3)])  # (2, 3): stopped inside an accumulation window
def test_grpo_trains_through_episodes_and_a_checkpoint_restore_changes_nothing(tmp_path, accumulate, stop):
    reference = trainer(accumulate=accumulate).fit(task_stream(), steps=5, log_every=5)
    first = trainer(tmp_path, accumulate).fit(task_stream(), steps=stop, log_every=5)
    assert int(first.step) == stop
    resumed = trainer(tmp_path, accumulate).fit(task_stream(), steps=5, log_every=5)
    assert int(resumed.updates) == int(reference.updates) >= 1  # a step whose every episode truncated makes none
    for got, want in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(reference.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    start = jax.jit(ToolPolicy().init)(jax.random.key(5), jnp.zeros((1, 4), jnp.int32))
    moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(reference.params), jax.tree.leaves(start)))
    assert moved > 0


def test_the_raw_and_behaviour_likelihoods_are_the_generations_own():
    model = ToolPolicy()
    variables = jax.jit(model.init)(jax.random.key(1), jnp.zeros((1, 4), jnp.int32))
    sampling = Sampling(eos_id=EOS, temperature=1.0, top_k=4)  # behaviour (top-k) differs from raw
    generated = []

    class Recording(TextGeneration):
        def bind(self, variables):
            bound = super().bind(variables)
            original = bound.__call__

            class Bound:
                def __call__(self, *args):
                    out = original(*args)
                    generated.append(jax.device_get(out))
                    return out
            return Bound()

    collector = rollout(Recording(model), sampling=sampling, max_turns=1)
    records = collector.collect(tasks(0, 1), variables, 0, jax.random.key(2))
    (generation,) = generated
    for record in records:
        (kept,) = record.actions
        row = record.episode.id.sample + 2 * record.group
        count = int(generation.lengths[row])
        assert kept.old_log_probs == tuple(generation.old_log_probs[row, :count].tolist())
        assert kept.behavior_log_probs == tuple(generation.behavior_log_probs[row, :count].tolist())
    assert any(k.old_log_probs != k.behavior_log_probs for r in records for k in r.actions)


def test_loss_gradients_reach_sampled_actions_only():
    collector = rollout(Scripted(square_then_answer))
    records = collector.collect(tasks(0, 1), None, 0, jax.random.key(0))
    records[1].reward = 0.0  # two rewards in task 0's group: non-zero advantages
    batch = {k: jnp.asarray(v) for k, v in collector.project(records).items()}
    model = ToolPolicy()
    objective = GRPOObjective(model, seq_len=10)
    variables = jax.jit(model.init)(jax.random.key(1), jnp.zeros((1, 4), jnp.int32))
    scores = objective.packed_log_probs(variables, batch)
    batch["old_log_probs"] = batch["behavior_log_probs"] = scores  # on policy: no token is clipped

    def loss_of(given):
        objective.packed_log_probs = lambda params, rows: given  # the loss sees the scores as a free input
        return objective.loss(variables, variables, batch, jax.random.key(0))[0]

    gradient = np.asarray(jax.grad(loss_of)(scores))
    sampled = np.asarray(batch["response_mask"]) != 0
    assert not gradient[~sampled].any()  # prompts and the tool's ids get none
    trained = sampled & (np.asarray(batch["advantages"]) != 0)
    assert trained.sum() == 8 and (gradient[trained] != 0).all()


@pytest.mark.parametrize("reply, eos, message", [
    (lambda n, c: [SQUARE, EOS, SQUARE], False, "sampled id 1 is an EOS id"),  # ids after EOS
    (lambda n, c: [SQUARE], False, None),  # a budget-hit draw: fine, truncated
])
def test_a_policy_draw_is_checked_like_every_action(reply, eos, message):
    collector = rollout(Scripted(reply, eos=eos), max_new_tokens=3)
    if message is None:
        assert all(r.status is EpisodeStatus.TRUNCATED for r in collector.collect(tasks(0), None, 0, jax.random.key(0)))
        return
    with pytest.raises(EpisodeFailure) as caught:
        collector.collect(tasks(0), None, 0, jax.random.key(0))
    assert message in str(caught.value.__cause__)


def test_non_finite_likelihoods_are_refused():
    class Broken(Scripted):
        def __call__(self, contexts, budget, key, sampling):
            out = super().__call__(contexts, budget, key, sampling)
            out.old_log_probs[0, 0] = np.nan
            return out

    with pytest.raises(EpisodeFailure) as caught:
        rollout(Broken(square_then_answer)).collect(tasks(0), None, 0, jax.random.key(0))
    assert "old_log_probs must be finite" in str(caught.value.__cause__)


def test_identities_carry_the_attempted_step_and_actions_the_committed_update_clock():
    calls = []

    class FirstTruncates(Scripted):
        def __call__(self, contexts, budget, key, sampling):
            self.eos = bool(calls)  # the first Trainer step's draws spend the budget: nothing to train
            calls.append(len(contexts))
            return super().__call__(contexts, budget, key, sampling)

    identities = []
    episodes = rollout(FirstTruncates(square_then_answer), record=lambda r: identities.append(
        (r.episode.id.step, {a.action.policy_step for a in r.actions})))
    model = ToolPolicy()
    trainer = Trainer(GRPOObjective(model, seq_len=10), optax.sgd(0.1), key=jax.random.key(0), rollout=episodes,
                      progress=False)
    state = trainer.fit(task_stream(), steps=2, log_every=2)
    assert int(state.step) == 2 and int(state.updates) == 1
    # step 0 made no update; step 1's episodes are attempt 1 at update clock 0
    assert {step for step, _ in identities} == {0, 1} and all(clock == {0} for _, clock in identities)


class Counting(Environment):
    """Context [10 + task, 10 + task]; each step appends the action's ids and 9; an action of 7 completes it."""

    def __init__(self, task: int):
        self.task = task

    def reset(self):
        return Observation((10 + self.task,) * 2)

    def step(self, action):
        status = EpisodeStatus.COMPLETED if action.tokens[0] == 7 else EpisodeStatus.RUNNING
        return Observation(action.context + action.tokens + (9,), status, "done" if action.tokens[0] == 7 else "")


def counting_reply(context):
    """Task 0 answers 7 on its second turn; 1 never answers; 2 spends its budget without EOS; 3 outgrows the context."""
    task, turn = context[0] - 10, (len(context) - 2) // 4
    return {0: [8, 8] if turn == 0 else [7], 1: [8], 2: [8, 8, 8, 8], 3: [8, 8]}.get(task, [])  # []: an inert row


class CountingServer(RolloutServer):
    """A RolloutServer whose draw is ``counting_reply`` then EOS, cut at the budget (no EOS then), at once."""

    version = 0

    def submit(self, prompt_ids, max_new_tokens, seed=0):
        ids = (counting_reply(tuple(prompt_ids)) + [EOS])[:max_new_tokens]
        future = DrawFuture()
        future.set_result(Draw(ids, [-0.25] * len(ids), [-0.5] * len(ids), eos=ids[-1] == EOS, version=0,
                               finish_reason="stop" if ids[-1] == EOS else "length"))
        return future

    def cancel(self, draw):
        pass

    def load(self, variables, version):
        pass


def test_both_collectors_follow_the_one_episode_driver():
    """EnvironmentSource (a draw per turn) and EpisodeRollout (one policy call per round) run the same episodes to the
    same calls, statuses, details and rewards: completion, a response without EOS kept from the tool, the turn
    limit and the context limit."""
    from dew.collection.sources import EnvironmentSource

    limits = {"max_prompt_tokens": 8, "max_new_tokens": 3, "max_turns": 3}
    transitions = lambda episode: float(len(episode.transitions))  # noqa: E731
    episodes = EpisodeRollout(ScriptedPolicy(counting_reply, EOS), lambda identity: Counting(identity.task),
                              transitions, groups=2, sampling=SAMPLING, **limits)
    records = episodes.collect(tasks(0, 1, 2, 3), None, 0, jax.random.key(0))
    with EnvironmentSource(CountingServer(), lambda task, identity: Counting(int(task.id)),
                           lambda task, episode: transitions(episode), workers=2, eos_ids=(EOS,), **limits) as source:
        sessions = [future.result(timeout=60) for task in range(4)
                    for future in source.submit(Task(str(task), {}), 0, 2)]

    def seen(session):
        return (session.task.id, session.sample, [(c.prompt_ids, c.sampled_ids) for c in session.calls],
                session.status, session.detail, session.reward)

    assert [seen(s) for s in sessions] == [seen(session_of(r)) for r in records]
    by_task = {s.task.id: s for s in sessions}
    assert (by_task["0"].status, by_task["0"].detail, by_task["0"].reward) == (Status.COMPLETED, "done", 2.0)
    assert by_task["1"].detail == "the episode needs more than max_turns=3 model calls" and by_task["1"].reward is None
    assert (by_task["2"].detail, by_task["2"].reward) == ("the response spent max_new_tokens=3 without EOS", 1.0)
    assert by_task["3"].detail == "a context of 10 ids exceeds max_prompt_tokens=8" and len(by_task["3"].calls) == 2
