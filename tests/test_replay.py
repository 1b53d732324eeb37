"""A run's record (Trainer(record=...)) and its bit-exact replay (dew.replay) without the rollout that made it.

The recorded run is asynchronous (the scheduler draws a batch ahead under older weights, on a
native server), so what it trained on depends on timing; the replay trains the recorded
batches again on a fresh Trainer and must reach the same parameters after every update and
the same checkpoints, bit for bit. A damaged record is refused naming the file. (The
pipeline's record under faults, killed servers and resubmissions included, is replayed by
tests/test_chaos.py.)"""

import json
import shutil

import jax
import numpy as np
import optax
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_rollout_scheduler import toy_prompts

from dew import Dataset, Trainer
from dew.collection.scheduler import RolloutScheduler
from dew.collection.sources import PromptSource
from dew.collection.tasks import prompt_tasks
from dew.inference import NativeRolloutServer, Server, ServingTask
from dew.objectives.grpo import GRPOObjective
from dew.objectives.lm import LMObjective
from dew.replay import replay
from dew.sampling import Sampling
from dew.update_record import RecordError, UpdateRecord, params_digest

WIDTH = 16
STEPS = 5


def grpo_trainer(model, served, **options) -> Trainer:
    objective = GRPOObjective(model, seq_len=WIDTH - 1, pretrained=served, behavior_importance=2.0)
    return Trainer(objective, optax.adam(3e-3), key=jax.random.key(0), progress=False, **options)


@pytest.fixture(scope="module")
def recorded(sharp_decoder, tmp_path_factory):
    """An asynchronous GRPO run of STEPS updates, recorded, with a checkpoint every 2 steps."""
    model, served = sharp_decoder
    root = tmp_path_factory.mktemp("recorded")
    serving = ServingTask(model, served, Sampling(eos_id=tuple(range(16)), temperature=1.0, top_k=8))
    with NativeRolloutServer(Server.from_task(serving, slots=4, capacity=64), version=-1) as server, \
            PromptSource(server, lambda ds, text, gt, extra: float(len(text.split()) % 2), max_new_tokens=4,
                         eos_ids=tuple(range(16)), workers=2) as source:
        trainer = grpo_trainer(model, served, output_dir=root / "checkpoints", checkpoint_every=2,
                               keep_checkpoints=None, record=root / "record")
        scheduler = RolloutScheduler(trainer.objective, source, server, width=WIDTH, rows=4, tasks=prompt_tasks,
                                     groups=2, max_lag=1, ahead=1)
        trainer.rollout = scheduler
        state = trainer.fit(scheduler.tasks(Dataset(train=lambda partition: toy_prompts())), steps=STEPS, log_every=1)
        scheduler.close()
    return model, served, root, state


def test_a_replay_reaches_every_update_and_checkpoint_bit_for_bit(recorded):
    model, served, root, state = recorded
    steps = list(UpdateRecord(root / "record").steps())
    assert [s.step for s in steps] == list(range(STEPS)) and all(s.batch is not None for s in steps)
    assert {"input_ids", "response_mask", "behavior_log_probs", "advantages", "lags"} <= set(steps[0].batch), sorted(steps[0].batch)
    report = replay(grpo_trainer(model, served), root / "record", checkpoints=root / "checkpoints")
    assert report.identical and report.first_mismatch is None, report.describe()
    assert (report.steps, report.updates) == (STEPS, STEPS)
    assert report.checkpoints == {2: True, 4: True, 5: True}, report.checkpoints
    assert steps[-1].params_digest == params_digest(state.params)


def test_a_replay_that_trains_otherwise_names_the_first_step_that_differs(recorded):
    model, served, root, _ = recorded
    objective = GRPOObjective(model, seq_len=WIDTH - 1, pretrained=served, behavior_importance=2.0)
    other = Trainer(objective, optax.adam(3e-3 * 1.001), key=jax.random.key(0), progress=False)
    report = replay(other, root / "record", checkpoints=root / "checkpoints")
    # a batch whose groups all scored alike has zero advantages and moves nothing, at any learning rate
    moved = next(s.step for s in UpdateRecord(root / "record").steps() if np.any(s.batch["advantages"] != 0))
    assert not report.identical and report.first_mismatch == moved and report.steps == moved + 1, report.describe()
    with pytest.raises(ValueError, match="initial parameters are not the run's start"):
        replay(grpo_trainer(model, jax.tree.map(lambda x: x * 1.5, served)), root / "record")


def test_a_damaged_or_incomplete_record_is_refused_naming_the_file(recorded, tmp_path):
    model, served, root, _ = recorded
    shutil.copytree(root / "record", tmp_path / "flipped")
    path = UpdateRecord(tmp_path / "flipped").step_path(2, 0)
    table = pq.read_table(path)
    batch = {name: table.column(name) for name in table.column_names}
    advantages = np.asarray(batch["advantages"].combine_chunks().flatten()).copy()
    advantages[0] += 1.0  # the batch changed, its digest left as it was
    flat = table.column("advantages").combine_chunks()
    changed = pa.FixedSizeListArray.from_arrays(pa.array(advantages), flat.type.list_size)
    pq.write_table(table.set_column(table.column_names.index("advantages"), table.schema.field("advantages"),
                                    changed), path)
    with pytest.raises(RecordError, match=r"step-00000002\.p0\.parquet: the batch does not match its recorded digest"):
        list(UpdateRecord(tmp_path / "flipped").steps())

    shutil.copytree(root / "record", tmp_path / "cut")
    UpdateRecord(tmp_path / "cut").step_path(1, 0).unlink()
    with pytest.raises(RecordError, match=r"step-00000001\.p0\.parquet is missing: .* gap at step 1"):
        replay(grpo_trainer(model, served), tmp_path / "cut")

    shutil.copytree(root / "record", tmp_path / "garbled")
    path = UpdateRecord(tmp_path / "garbled").step_path(3, 0)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(RecordError, match=r"step-00000003\.p0\.parquet is not a readable record step"):
        list(UpdateRecord(tmp_path / "garbled").steps())

    shutil.copytree(root / "record", tmp_path / "moved")
    start = tmp_path / "moved" / "start.p0.json"
    start.write_text(json.dumps({**json.loads(start.read_text()), "mesh": {"data": 2}}))
    with pytest.raises(RecordError, match="was recorded on 1 device.* with mesh {'data': 2}"):
        replay(grpo_trainer(model, served), tmp_path / "moved")
    with pytest.raises(RecordError, match="holds no run record"):
        replay(grpo_trainer(model, served), tmp_path / "nothing")
    shutil.copytree(root / "record", tmp_path / "group")
    shutil.copy(tmp_path / "group" / "start.p0.json", tmp_path / "group" / "start.p1.json")
    with pytest.raises(RecordError, match="record of 2 trainer processes .* replay covers runs of one"):
        replay(grpo_trainer(model, served), tmp_path / "group")


def test_a_resumed_run_records_its_steps_again_and_replays_to_the_resumed_parameters(sharp_decoder, tmp_path):
    """A run that took 3 steps past its checkpoint at 2 and died resumes there: step 2 is recorded again."""
    model, served = sharp_decoder
    rng = np.random.default_rng(0)

    def batches(partition):
        while True:
            yield {"text": rng.integers(0, 32, size=(4, WIDTH)).astype(np.int32)}

    def trainer(**options):
        return Trainer(LMObjective(model, seq_len=WIDTH - 1, pretrained=served), optax.adam(1e-3),
                       key=jax.random.key(1), progress=False, **options)

    stored = {"output_dir": tmp_path / "out", "record": tmp_path / "record"}
    with trainer(**stored).start(Dataset(train=batches)) as run:
        for _ in range(3):
            run.step()
            if run.steps == 2:
                run.save()
    stale = UpdateRecord(tmp_path / "record").step_path(2, 0).read_bytes()
    with trainer(**stored).start(Dataset(train=batches)) as run:  # the stream's generator has moved on
        assert run.steps == 2
        while run.steps < 5:
            run.step()
        run.save()
        final = params_digest(run.state.params)
    assert UpdateRecord(tmp_path / "record").step_path(2, 0).read_bytes() != stale
    report = replay(trainer(), tmp_path / "record", checkpoints=tmp_path / "out")
    assert report.identical and report.steps == 5 and report.checkpoints == {2: True, 5: True}, report.describe()
    assert list(UpdateRecord(tmp_path / "record").steps())[-1].params_digest == final
