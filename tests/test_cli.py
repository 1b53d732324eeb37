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
    import urllib.error
    import urllib.request

    from conftest import ROOT, free_port

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("VLLM_API_KEY", None)
    refused = subprocess.run([sys.executable, "-m", "dew_ray.cli", "serve", "--host", "0.0.0.0"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "beyond loopback, without an API key" in refused.stderr
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "dew_ray.cli", "serve", "--port", str(port), "--train-steps", "20", "--slots", "2",
         "--capacity", "64", "--block-size", "16", "--api-key", "sesame"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        line = ""
        while "dew-ray serve:" not in line:  # training log lines come first
            line = process.stdout.readline()
            assert line, "dew-ray serve exited before it served"
        assert f"http://127.0.0.1:{port}/v1" in line
        assert "API key required on /v1" in line
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 5, "seed": 3}).encode()
        for key in (None, "open sesame"):  # no key, a wrong key: 401, as vLLM answers
            headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
            with pytest.raises(urllib.error.HTTPError) as denied:
                urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                                              headers=headers), timeout=60)
            assert denied.value.code == 401 and json.loads(denied.value.read()) == {"error": "Unauthorized"}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=60) as response:  # open, as vLLM's
            assert json.loads(response.read())["status"] == "ok"
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": "Bearer sesame"})
        with urllib.request.urlopen(request, timeout=60) as response:
            reply = json.loads(response.read())
        assert reply["choices"][0]["finish_reason"] in ("stop", "length") and reply["model"] == "dew-stories"
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_fleet_requests_go_to_a_running_runs_directory_and_are_withdrawn_when_no_driver_takes_them(capsys, tmp_path):
    """``dew-ray fleet`` refuses a directory that holds no run or a finished run and a count below 1, queues a request
    the driver's model reads back (``--wait 0``), and withdraws one no driver took within ``--wait``. The driver's
    side is tests/test_multinode.py's fleet test."""
    from dew_ray.pipelines.rlvr_fleet import REQUESTS, FleetRequest

    assert main(["fleet", str(tmp_path), "--add", "1"]) == 2
    assert "is not the directory of a dew-ray rlvr run (it has no config.json)" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["fleet", str(tmp_path), "--add", "0"]) == 2
    assert "count" in capsys.readouterr().err and not (tmp_path / REQUESTS).exists()
    assert main(["fleet", str(tmp_path), "--remove", "2", "--drain", "5", "--wait", "0"]) == 0
    (queued,) = (tmp_path / REQUESTS).glob("*.json")
    assert queued.stem in capsys.readouterr().out
    assert FleetRequest.model_validate_json(queued.read_text()) == FleetRequest(change="remove", count=2, drain=5)
    queued.unlink()
    assert main(["fleet", str(tmp_path), "--add", "1", "--wait", "0.2"]) == 3
    assert "did not take the request within 0.2 s" in capsys.readouterr().err
    assert list((tmp_path / REQUESTS).iterdir()) == []
    (tmp_path / "summary.json").write_text("{}")
    assert main(["fleet", str(tmp_path), "--add", "1"]) == 2
    assert "has finished" in capsys.readouterr().err
