import pytest

from dew_ray.cli import main


@pytest.mark.slow
def test_sft_demo_lowers_validation_loss(capsys, tmp_path):
    assert main(["sft-demo", "--steps", "60", "--log-every", "30", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    summary = next(line for line in out.splitlines() if line.startswith("validation loss"))
    before, after = (float(x) for x in summary.split()[2:5:2])
    assert after < before - 1.0
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "60").is_dir()


def test_unknown_command_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["grpo-demo"])
    assert "invalid choice: 'grpo-demo'" in capsys.readouterr().err
