"""The RLVR driver's record of a run: one metrics row per update, held-out points, verl rows, and a resume that keeps
what the restored checkpoint holds."""

import json

import pytest

from dew.experiment_trackers import MetricWriters, TensorBoard
from dew_ray.pipelines.run_record import RunRecord, update_row
from tracker_files import tensorboard_scalars


def result(step, tasks, verdicts, scheduler=None, verl=()):
    report = {"tasks": tasks, "verdicts": verdicts, "verl_rows": list(verl)}
    if scheduler is not None:
        report["scheduler"] = scheduler
    return ({"step": step, "updates": step, "loss": 0.5, "report": report},)


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_row_folds_every_process_report_and_process_zero_scheduler():
    results = [result(3, [1, 2], {"correct": 1, "wrong": 1}, {"waited": 0.25, "lag": 1, "rollout/reward/mean": 0.5},
                      verl=[{"id": "a"}]),
               result(3, [3], {"correct": 2}, {"waited": 9.0, "lag": 7}, verl=[{"id": "b"}])]
    row, verl_rows, scheduler = update_row(results, wall=2.0, servers=2)
    assert row == {"step": 3, "updates": 3, "wall": 2.0, "waited": 0.25, "tasks": [1, 2, 3],
                   "verdicts": {"correct": 3, "wrong": 1}, "train/loss": 0.5, "scheduler/lag": 1,
                   "rollout/reward/mean": 0.5, "fleet/servers": 2}
    assert verl_rows == [{"id": "a"}, {"id": "b"}] and scheduler == {"lag": 1, "rollout/reward/mean": 0.5}


def test_a_resume_keeps_what_the_checkpoint_holds_and_the_retrained_updates_write_once(tmp_path):
    record = RunRecord(tmp_path)
    record.resume(0, {"all": 0.1}, MetricWriters([TensorBoard()], tmp_path))
    for step in (1, 2, 3):
        row = {"step": step, "updates": step, "wall": 1.0, "waited": 0.5}
        record.write(row, [{"step": step}])
        record.keep(row)
        if step == 2:
            record.held_out(2, {"all": 0.3})
    assert record.wait_share() == 0.5
    record.close()

    again = RunRecord(tmp_path)  # the checkpoint holds update 2: update 3 is trained again
    again.resume(2, {"all": 0.1}, MetricWriters([], tmp_path))
    assert [row["step"] for row in again.rows] == [1, 2] == [row["step"] for row in lines(tmp_path / "metrics.jsonl")]
    assert again.curve == [{"step": 0, "reward": {"all": 0.1}}, {"step": 2, "reward": {"all": 0.3}}]
    assert sorted(path.name for path in (tmp_path / "verl_rows").iterdir()) == ["update-000001.jsonl",
                                                                               "update-000002.jsonl"]
    again.write({"step": 3, "updates": 3, "wall": 1.0, "waited": None}, None)
    assert [row["step"] for row in lines(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert not (tmp_path / "verl_rows" / "update-000003.jsonl").exists()
    assert tensorboard_scalars(tmp_path / "tensorboard")["held_out/all"] == [(0, pytest.approx(0.1)), (2, pytest.approx(0.3))]
