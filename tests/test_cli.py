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


@pytest.mark.slow
def test_serve_answers_over_http():
    import json
    import os
    import subprocess
    import sys
    import urllib.request

    from conftest import ROOT, free_port

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "dew_ray.cli", "serve", "--port", str(port), "--train-steps", "20", "--slots", "2",
         "--capacity", "64", "--block-size", "16"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        line = ""
        while "dew-ray serve:" not in line:  # training log lines come first
            line = process.stdout.readline()
            assert line, "dew-ray serve exited before it served"
        assert f"http://127.0.0.1:{port}/v1" in line
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 5, "seed": 3}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            reply = json.loads(response.read())
        assert reply["choices"][0]["finish_reason"] in ("stop", "length") and reply["model"] == "dew-stories"
    finally:
        process.terminate()
        process.wait(timeout=30)
