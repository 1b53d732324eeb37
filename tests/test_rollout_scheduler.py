"""RolloutScheduler: each admission rule on a fake in-memory source, then end to end with the Trainer."""

import itertools
import random
from concurrent.futures import Future

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.inference import WeightPublisher

from dew import Dataset, Trainer
from dew.data.prompts import utf8_column
from dew.inference import NativeRolloutServer, Server, ServingTask
from dew.collection.sources import PromptSource
from dew.objectives.grpo import GRPOObjective
from dew.collection.scheduler import RolloutScheduler, SchedulerRecord
from dew.collection.tasks import prompt_tasks, task_ids
from dew.records.session_records import Call, Session, SessionSource, Status
from dew.sampling import Sampling

WIDTH = 8  # seq_len 7


def session(task, group, status, reward=1.0, version=0, calls=None):
    calls = calls or [Call(prompt_ids=[1, 2], sampled_ids=[3, 4], behavior_log_probs=[-1.0, -1.0],
                           finish_reason="stop", version=version)]
    return Session(task=task, group=group, sample=0, attempt=0, calls=calls, status=status, reward=reward)


class FakeSource(SessionSource):
    """Futures resolved by a script: ``plan(task, group, submission) -> Session | Exception | None`` (None: pending).

    ``submission`` counts this source's submissions of (task id) from 0, one per sample.
    """

    def __init__(self, plan):
        self.plan = plan
        self.count: dict = {}
        self.submitted: list = []  # (task id, group, future)
        self.cancelled: list = []

    def submit(self, task, group, samples):
        futures = []
        for _ in range(samples):
            n = self.count.get(task.id, 0)
            self.count[task.id] = n + 1
            future = Future()
            outcome = self.plan(task, group, n)
            if isinstance(outcome, Exception):
                future.set_exception(outcome)
            elif outcome is not None:
                future.set_result(outcome)
            self.submitted.append((task.id, group, future))
            futures.append(future)
        return futures

    def cancel(self, future):
        self.cancelled.append(future)
        if not future.done():
            future.set_result(Session(task=None, group=-1, sample=0, attempt=0, calls=[], status=Status.CANCELLED))


class FakeWeights(WeightPublisher):
    def __init__(self, version=0, stuck=0):
        self.served, self.stuck, self.loads = version, stuck, []

    @property
    def version(self):
        return self.served

    def load(self, params, version):
        self.loads.append(version)
        if self.stuck > 0:
            self.stuck -= 1
        else:
            self.served = version


@pytest.fixture
def objective(tiny_model):
    return GRPOObjective(tiny_model, seq_len=WIDTH - 1, behavior_importance=2.0)


@pytest.fixture
def variables(tiny_model):
    return jax.jit(tiny_model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


def ids_batch(*ids):
    return {"task_id": np.array(ids, np.int64)}


def make(objective, plan, weights=None, **options):
    records = []
    options = {"width": WIDTH, "rows": 4, "groups": 2, "max_lag": 1, "ahead": 0, **options}
    source = FakeSource(plan)
    scheduler = RolloutScheduler(objective, source, weights or FakeWeights(), log=records.append, **options)
    return scheduler, source, records


def always(status, reward=1.0):
    return lambda task, group, n: session(task, group, status, reward)


# ----- construction ---------------------------------------------------------------------------


def test_construction_checks(objective, tiny_model):
    with pytest.raises(ValueError, match=r"max_lag=1 is below ahead \+ sync_every - 1 = 2 \+ 1 - 1 = 2"):
        make(objective, always(Status.COMPLETED), max_lag=1, ahead=2)
    bare = GRPOObjective(tiny_model, seq_len=WIDTH - 1)
    with pytest.raises(ValueError, match="behavior_importance"):
        make(bare, always(Status.COMPLETED), max_lag=1)
    make(bare, always(Status.COMPLETED), max_lag=0, ahead=0)  # fully on-policy needs no correction
    with pytest.raises(ValueError, match="groups must be an integer >= 2, got 1"):
        make(objective, always(Status.COMPLETED), groups=1)
    with pytest.raises(ValueError, match="width must be the objective's seq_len \\+ 1 = 8, got 9"):
        make(objective, always(Status.COMPLETED), width=9)
    with pytest.raises(ValueError, match="truncation must be one of"):
        make(objective, always(Status.COMPLETED), truncation="drop")

    class LooksLikeWeights:  # load and version, but not a publisher: the scheduler checks the type
        version = 0

        def load(self, variables, version):
            pass

    with pytest.raises(TypeError, match="weights must be a dew.inference.WeightPublisher"):
        make(objective, always(Status.COMPLETED), weights=LooksLikeWeights())


# ----- admission by status --------------------------------------------------------------------


STATUSES = [(Status.COMPLETED, 1.0), (Status.AGENT_ERROR, 0.0), (Status.TRUNCATED, 1.0), (Status.TRUNCATED, None)]


def by_sample(task, group, n):
    status, reward = STATUSES[n] if n < 4 else (Status.COMPLETED, 0.5)
    return session(task, group, status, reward)


@pytest.mark.parametrize("truncation, trained, resubmitted", [
    ("mask", 2, {}),  # both truncations complete the group, take no rows
    ("zero", 4, {}),  # both train on reward 0
    ("score", 4, {"unscored_truncation": 1}),  # the unscored one goes again and comes back COMPLETED
])
def test_admission_by_status(objective, variables, truncation, trained, resubmitted):
    scheduler, source, records = make(objective, by_sample, groups=4, truncation=truncation)
    batch = scheduler(ids_batch(7), variables, 0, None)
    (record,) = records
    assert record.admitted_groups == 1 and record.resubmissions == resubmitted
    assert len(set(batch["session_index"][batch["response_mask"] == 1].tolist())) == trained
    objective.validate(batch)


def spy_admitted(scheduler):
    """A list that fills with the relabelled sessions the scheduler admits."""
    seen, collect = [], scheduler._collect

    def spy(*args):
        admitted, cut = collect(*args)
        seen.extend(s for group in admitted for s, _ in group.admitted)
        return admitted, cut

    scheduler._collect = spy
    return seen


def test_relabelling_and_proximal_rescoring(objective, variables):
    def plan(task, group, n):
        if n == 1:
            return session(task, group, Status.INFRA_ERROR, None)
        return session(task, group, Status.COMPLETED, float(n))

    scheduler, source, records = make(objective, plan, groups=2)
    seen = spy_admitted(scheduler)
    batch = scheduler(ids_batch(5, 6), variables, 0, None)
    # Task 5 draws samples 0 (n=0) and 1 (n=1 fails, n=2 replaces it); task 6 (its own count) the same.
    labels = sorted((s.task.id, s.group, s.sample, s.attempt, s.reward) for s in seen)
    assert labels == [("5", 0, 0, 0, 0.0), ("5", 0, 1, 1, 2.0), ("6", 1, 0, 0, 0.0), ("6", 1, 1, 1, 2.0)]
    assert records[0].resubmissions == {"infra_error": 2}
    mask = batch["response_mask"] == 1
    expected = np.asarray(objective.packed_log_probs(variables, {k: jnp.asarray(v) for k, v in batch.items()}))
    np.testing.assert_allclose(batch["old_log_probs"][mask], expected[mask], rtol=1e-6)
    assert (batch["behavior_log_probs"][mask] == -1.0).all()  # the engine's numbers stay


def test_retry_then_abandon_after_max_attempts(objective, variables):
    def plan(task, group, n):
        if task.id == "1" and n in (0, 2, 3):  # sample 0 fails three times: n=0, then its retries n=2, n=3
            return session(task, group, Status.INFRA_ERROR, None)
        if task.id == "2" and n == 0:
            return session(task, group, Status.CANCELLED, None)
        return session(task, group, Status.COMPLETED, 1.0)

    scheduler, source, records = make(objective, plan, max_attempts=3)
    batch = scheduler(ids_batch(1, 2), variables, 0, None)
    (record,) = records
    assert record.abandoned_groups == 1 and record.admitted_groups == 1
    assert record.resubmissions == {"infra_error": 2, "cancelled": 1}  # the third failure abandons, no resubmit
    assert len(set(batch["session_index"][batch["response_mask"] == 1].tolist())) == 2


# ----- staleness and timeouts -----------------------------------------------------------------


def test_stale_rollouts_are_discarded_and_running_ones_cancelled(objective, variables):
    weights = FakeWeights(version=3)

    def plan(task, group, n):
        if task.id == "1":  # finished, but its call is from version 1: 3 - 1 > max_lag
            return session(task, group, Status.COMPLETED, 1.0, version=1 if n == 0 else weights.version)
        return session(task, group, Status.COMPLETED, 1.0, version=weights.version)

    scheduler, source, records = make(objective, plan, weights=weights)
    scheduler(ids_batch(1), variables, 3, None)
    assert records[-1].resubmissions == {"stale": 1} and records[-1].oldest_version == 3 and records[-1].lag == 0


def test_running_rollout_past_the_bound_is_cancelled_without_waiting(objective, variables):
    weights = FakeWeights(version=0)
    live = {"hold": True}

    def plan(task, group, n):
        if task.id == "2" and live["hold"]:
            return None  # running until cancelled
        return session(task, group, Status.COMPLETED, 1.0, version=weights.version)

    scheduler, source, records = make(objective, plan, weights=weights, ahead=1)
    first, second = ids_batch(1), ids_batch(2)
    scheduler.register(first)
    scheduler.register(second)
    scheduler(first, variables, 0, None)  # batch 1 (task 2) goes out under version 0 and keeps running
    live["hold"] = False
    scheduler(second, variables, 2, None)  # 2 - 0 > max_lag: cancelled, resubmitted under version 2
    assert records[-1].resubmissions == {"stale_running": 2} and records[-1].cancellations == 2
    assert len(source.cancelled) == 2 and records[-1].oldest_version == 2 and weights.loads == [2]


def test_timeout_cancels_and_resubmits_as_a_failed_attempt(objective, variables):
    def plan(task, group, n):
        return None if n == 0 else session(task, group, Status.COMPLETED, 1.0)

    scheduler, source, records = make(objective, plan, timeout=0.2, max_lag=0, ahead=0)
    scheduler(ids_batch(1), variables, 0, None)
    (record,) = records
    assert record.resubmissions == {"timeout": 1} and record.cancellations == 1
    assert 0.2 <= record.waited < 5
    assert source.cancelled == [source.submitted[0][2]]


# ----- oversample and admit -------------------------------------------------------------------


def test_oversample_admits_the_first_to_finish(objective, variables):
    def plan(task, group, n):
        return None if n < 2 else session(task, group, Status.COMPLETED, float(n))

    scheduler, source, records = make(objective, plan, groups=2, oversample=2)
    seen = spy_admitted(scheduler)
    scheduler(ids_batch(1), variables, 0, None)
    assert sorted(s.sample for s in seen) == [2, 3]  # samples 0 and 1 were still running
    assert records[0].cancellations == 2 and len(source.cancelled) == 2


def test_admit_takes_the_first_complete_groups_and_cancels_the_rest(objective, variables):
    def plan(task, group, n):
        return session(task, group, Status.COMPLETED, float(n)) if task.id == "2" else None

    scheduler, source, records = make(objective, plan, admit=1)
    batch = scheduler(ids_batch(1, 2, 3), variables, 0, None)
    (record,) = records
    assert record.admitted_groups == 1 and record.cancellations == 4  # two samples each of tasks 1 and 3
    assert len(set(batch["session_index"][batch["response_mask"] == 1].tolist())) == 2


# ----- packing limits -------------------------------------------------------------------------


def test_a_group_that_does_not_fit_is_cut(objective, variables):
    # Each session is one chain of 4 ids: two fit a row of 8, so a group of 2 fills one row.
    scheduler, source, records = make(objective, always(Status.COMPLETED), rows=1)
    batch = scheduler(ids_batch(1, 2), variables, 0, None)
    assert records[0].admitted_groups == 1 and records[0].cut_groups == 1
    assert batch["input_ids"].shape == (1, WIDTH)


def test_a_group_that_cannot_fit_on_its_own_raises(objective, variables):
    calls = [Call([1, 2], [3, 4], [-1.0, -1.0], "stop", 0), Call([5, 6], [7, 8], [-1.0, -1.0], "stop", 0)]

    def plan(task, group, n):  # calls that do not extend each other: two chains of 4 per session
        return session(task, group, Status.COMPLETED, 1.0, calls=calls)

    scheduler, source, records = make(objective, plan, rows=1)
    with pytest.raises(ValueError, match="packs into 2 rows of width 8 on its own; rows=1"):
        scheduler(ids_batch(1), variables, 0, None)


# ----- weights --------------------------------------------------------------------------------


def test_weight_push_cadence(objective, variables):
    weights = FakeWeights()
    plan = lambda task, group, n: session(task, group, Status.COMPLETED, 1.0, version=weights.version)  # noqa: E731
    scheduler, source, records = make(objective, plan, weights=weights, sync_every=2,
                                      max_lag=2, ahead=1)
    for version in range(5):
        scheduler(ids_batch(version), variables, version, None)
    assert weights.loads == [2, 4]  # pushed whenever the served version fell 2 behind
    assert [r.pushed for r in records] == [False, False, True, False, True]


def test_a_push_that_does_not_move_the_version_is_retried_once_then_raises(objective, variables):
    weights = FakeWeights(stuck=1)
    scheduler, _, _ = make(objective, always(Status.COMPLETED), weights=weights)
    scheduler(ids_batch(1), variables, 1, None)
    assert weights.loads == [1, 1] and weights.version == 1
    weights.stuck = 2
    with pytest.raises(RuntimeError, match="left the served version at 1"):
        scheduler(ids_batch(2), variables, 2, None)
    assert weights.loads == [1, 1, 2, 2]


# ----- failures of the source -----------------------------------------------------------------


def test_a_source_that_raises_cancels_the_batch_and_propagates(objective, variables):
    def plan(task, group, n):
        if task.id == "1":
            return RuntimeError("harness crashed") if n == 0 else None
        return None

    scheduler, source, _ = make(objective, plan)
    with pytest.raises(RuntimeError, match="harness crashed"):
        scheduler(ids_batch(1, 2), variables, 0, None)
    pending = [f for _, _, f in source.submitted[1:]]
    assert set(source.cancelled) == set(pending)  # the batch's other work stops

    class Broken(FakeSource):
        def submit(self, task, group, samples):
            raise ConnectionError("gateway down")

    scheduler = RolloutScheduler(objective, Broken(None), FakeWeights(), width=WIDTH, rows=4, groups=2, ahead=0)
    with pytest.raises(ConnectionError, match="gateway down"):
        scheduler(ids_batch(1), variables, 0, None)


def test_fault_injection_every_batch_completes_on_whole_groups(objective, variables):
    rng = random.Random(0)
    weights = FakeWeights()

    def plan(task, group, n):  # 20% of draws come back INFRA_ERROR
        if rng.random() < 0.2:
            return session(task, group, Status.INFRA_ERROR, None)
        return session(task, group, Status.COMPLETED, float(rng.random() < 0.5), version=weights.version)

    scheduler, source, records = make(objective, plan, weights=weights, groups=4, rows=8, max_attempts=6)
    for step in range(10):
        batch = scheduler(ids_batch(*range(4 * step, 4 * step + 4)), variables, step, None)
        record = records[-1]
        trained = set(batch["session_index"][batch["response_mask"] == 1].tolist())
        assert record.abandoned_groups == 0 and record.admitted_groups == 4
        assert len(trained) == 4 * 4  # every group trains on all 4 samples, never a partial set
    assert sum(r.resubmissions.get("infra_error", 0) for r in records) > 10


# ----- converters and the stream --------------------------------------------------------------


def test_converters_and_the_ahead_stream(objective, variables):
    (task,) = task_ids(ids_batch(9))
    assert task.id == "9" and task.data == {"task_id": 9}
    prompts = {"prompt": np.array([[0, 0, 3, 4]], np.int32), "prompt_length": np.array([2], np.int32),
               "data_source": utf8_column(["toy"]), "ground_truth": utf8_column(["7"]),
               "extra_info": np.zeros((1, 0), np.int32)}
    (task,) = prompt_tasks(prompts)
    assert task.data == {"prompt_ids": [3, 4], "data_source": "toy", "ground_truth": "7", "extra_info": ""}

    class Positioned:
        def __init__(self):
            self.at = 0

        def __next__(self):
            self.at += 1
            return ids_batch(self.at - 1)

        def __iter__(self):
            return self

        def position(self):
            return self.at

        def restore(self, position):
            self.at = position

    scheduler, source, _ = make(objective, always(Status.COMPLETED), ahead=2, max_lag=2)
    stream = scheduler.tasks(Dataset(train=lambda partition: Positioned())).train(None)
    first = next(stream)
    tasks = len(scheduler._queue[0].tasks)
    # read 0..2, handed over 0: next is 1, whose groups are numbered after batch 0's
    assert len(scheduler._queue) == 3 and stream.position() == {"stream": 1, "group": tasks}
    scheduler(first, variables, 0, None)
    assert sorted({t for t, _, _ in source.submitted}) == ["0", "1", "2"]  # batches 1 and 2 went out ahead
    groups = {t: g for t, g, _ in source.submitted}
    stream.restore({"stream": 1, "group": tasks})
    assert len(scheduler._queue) == 0 and int(next(stream)["task_id"][0]) == 1
    # a resumed stream numbers batch 1's groups as the first run did (their seeds depend on it)
    assert scheduler._queue[0].first_group == groups["1"] == tasks
    stream.restore(1)  # a position from a checkpoint written before positions carried the group numbering
    assert int(next(stream)["task_id"][0]) == 1


# ----- end to end -----------------------------------------------------------------------------


def toy_prompts():
    """Two 3-id prompts per batch, endlessly, as verl rows."""
    for step in itertools.count():
        rows = [[20 + step % 5, 21, 22], [23, 24, 25 + step % 3]]
        yield {"prompt": np.array(rows, np.int32), "prompt_length": np.array([3, 3], np.int32),
               "data_source": utf8_column(["toy"] * 2), "ground_truth": utf8_column(["x"] * 2),
               "extra_info": np.zeros((2, 0), np.int32)}


def test_end_to_end_with_the_trainer(sharp_decoder):
    model, served = sharp_decoder
    width = 16
    objective = GRPOObjective(model, seq_len=width - 1, behavior_importance=2.0)
    serving = ServingTask(model, served, Sampling(eos_id=tuple(range(16)), temperature=1.0, top_k=8))

    records = []
    with NativeRolloutServer(Server.from_task(serving, slots=4, capacity=64), version=-1) as server, \
            PromptSource(server, lambda ds, text, gt, extra: float(len(text.split()) % 2), max_new_tokens=4,
                         eos_ids=tuple(range(16)), workers=2) as source:
        scheduler = RolloutScheduler(objective, source, server, width=width, rows=4, tasks=prompt_tasks, groups=2,
                                     max_lag=1, ahead=1, log=records.append)
        trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0), rollout=scheduler, progress=False)
        state = trainer.fit(scheduler.tasks(Dataset(train=lambda partition: toy_prompts())), steps=3, log_every=1)
        scheduler.close()
        assert int(state.updates) == 3 and server.version == 2  # pushed before each call: -1 -> 0, 1, 2
    assert len(records) == 3 and all(isinstance(r, SchedulerRecord) for r in records)
    assert [r.pushed for r in records] == [True, True, True]
    assert all(r.admitted_groups == 2 and r.lag is not None and r.lag <= 1 for r in records)
    assert records[1].oldest_version == 0  # batch 1 went out ahead under version 0, trained at version 1
    assert all("latency/p50" in r.metrics for r in records)


def test_reopening_the_stream_cancels_what_the_old_one_left_running(objective, variables):
    scheduler, source, _ = make(objective, lambda task, group, n: None, ahead=1)
    data = scheduler.tasks(Dataset(train=lambda partition: (ids_batch(i) for i in itertools.count())))
    stream = data.train(None)
    first = next(stream)
    scheduler._submit_batch(scheduler._take(first))  # batch 0 running, as if its call were under way
    scheduler._submit_batch(scheduler._queue[0])  # batch 1 running ahead
    data.train(None)  # a restart opens the stream again
    assert len(source.cancelled) == 2 and len(scheduler._queue) == 0  # only the queued batch 1 was still owned
    with pytest.raises(KeyError, match="needs a 'task_id' field"):
        task_ids({"prompt": np.zeros((1, 2), np.int32)})
    with pytest.raises(ValueError, match="prompt_length 3 of row 0 must lie in"):
        prompt_tasks({"prompt": np.zeros((1, 2), np.int32), "prompt_length": np.array([3])})
    with pytest.raises(KeyError, match="neither 'task_id' nor 'prompt'"):
        scheduler({"x": np.zeros(1)}, variables, 0, None)
