"""dew.config: the pydantic + TOML loader every pipeline shares, and its named errors for each kind of bad value."""

import pytest

from dew.config import ConfigError, load_config
from dew.recipes.rlvr_recipe import RLVRConfig
from dew_ray.pipelines.rlvr_config import RLVRPipelineConfig


@pytest.mark.parametrize("values, message", [
    (dict(steps="ten"), "config field 'steps' must be an integer, got 'ten'"),  # wrong type
    (dict(steps=True), "config field 'steps' must be an integer, got True"),  # a bool is not a number
    (dict(steps=2.5), "config field 'steps' must be an integer, got 2.5"),
    (dict(servers=0), "config field 'servers' must be an integer >= 1, got 0"),  # below a bound
    (dict(samples=1), "config field 'samples' must be an integer >= 2, got 1"),
    (dict(learning_rate=0), "config field 'learning_rate' must be a number > 0, got 0"),
    (dict(learning_rate=1.5), "config field 'learning_rate' must be a number < 1, got 1.5"),  # above a bound
    (dict(clip=float("nan")), "config field 'clip' must be a finite number, got nan"),  # not finite
    (dict(trainer_cpus="one"), "config field 'trainer_cpus' must be a number, got 'one'"),
    (dict(runner="docker"), "config field 'runner' must be one of 'bwrap', 'process' or 'container', got 'docker'"),  # a choice
    (dict(progress="yes"), "config field 'progress' must be true or false, got 'yes'"),
    (dict(run_dir=3), "config field 'run_dir' must be a string, got 3"),
    (dict(width=64), "unknown config field 'width'; known: \\["),  # a field that does not exist
    (dict(max_lag=0), "'max_lag' \\(0\\) must be at least ahead \\+ sync_every - 1 = 1"),  # a rule across fields
    (dict(tasks_per_step=3, trainers=2), "'tasks_per_step' \\(3\\) must divide evenly over trainers=2"),
    (dict(prompts="none.jsonl"), "'prompts' names 'none.jsonl', which is not a file"),
    (dict(learning_rate_floor=1.5), "config field 'learning_rate_floor' must be a number <= 1, got 1.5"),
    (dict(stale_token_weight=0.5), "'stale_token_weight' \\(0.5\\) needs max_token_lag"),
    (dict(servers=3, servers_max=2), "'servers_min' \\(3\\), 'servers' \\(3\\) and 'servers_max' \\(2\\) must be in order"),
    (dict(servers=2, servers_max=4, engine="vllm"), "'servers_max' \\(4\\) above 'servers' \\(2\\) needs engine='native'"),
    (dict(deterministic=True, engine="vllm"), "'deterministic' needs engine='native': vLLM's batch-invariant mode"),
])
def test_each_kind_of_bad_value_is_named(values, message):
    with pytest.raises(ConfigError, match=message):
        RLVRPipelineConfig(**values)


def test_overrides_are_read_as_their_fields_type(tmp_path):
    config = load_config(RLVRPipelineConfig, None, ["steps=40", "learning_rate=3e-4", "progress=no", "prompts=none",
                                                    "run_dir=runs/a", "trainer_cpus=2"])
    assert (config.steps, config.learning_rate, config.progress, config.prompts) == (40, 3e-4, False, None)
    assert config.run_dir == "runs/a" and config.trainer_cpus == 2.0
    with pytest.raises(ConfigError, match="cannot read 'many' as config field 'servers' \\(an integer\\)"):
        load_config(RLVRPipelineConfig, None, ["servers=many"])
    with pytest.raises(ConfigError, match="an override must read key=value, got 'steps'"):
        load_config(RLVRPipelineConfig, None, ["steps"])
    with pytest.raises(ConfigError, match="unknown config field 'stepz' in override 'stepz=3'"):
        load_config(RLVRPipelineConfig, None, ["stepz=3"])
    with pytest.raises(ConfigError, match="config field 'servers' must be an integer >= 1, got 0"):
        load_config(RLVRPipelineConfig, None, ["servers=0"])  # read, then checked like any value


def test_toml_files_flat_or_under_the_pipelines_table(tmp_path):
    flat, table, broken, unknown = (tmp_path / name for name in ("flat.toml", "table.toml", "broken.toml", "x.toml"))
    flat.write_text("steps = 7\nservers = 2\n")
    table.write_text("[rlvr]\nsteps = 9\n")
    broken.write_text("steps = = 1\n")
    unknown.write_text("[rlvr]\nwidth = 64\n")
    assert load_config(RLVRPipelineConfig, flat, table="rlvr").servers == 2
    assert load_config(RLVRPipelineConfig, table, ["steps=11"], table="rlvr").steps == 11  # overrides come after
    assert load_config(RLVRPipelineConfig, table, table="rlvr", steps=12).steps == 12  # then keyword values
    with pytest.raises(ConfigError, match="broken.toml is not valid TOML"):
        load_config(RLVRPipelineConfig, broken)
    with pytest.raises(ConfigError, match="x.toml: unknown config field 'width'"):
        load_config(RLVRPipelineConfig, unknown, table="rlvr")
    with pytest.raises(ConfigError, match="config field 'steps' must be an integer, got '7'"):
        flat.write_text('steps = "7"\n')  # TOML values keep their type: a quoted number is a string
        load_config(RLVRPipelineConfig, flat)


def test_configs_are_frozen():
    config = RLVRConfig(steps=5)
    with pytest.raises(Exception, match="frozen"):
        config.steps = 6
    assert config.steps == 5


def test_help_prints_each_description_once_whole_and_without_sphinx_markup():
    from dew.config import fields_help, plain_text
    from dew_ray.pipelines.rlvr_config import RLVRPipelineConfig

    text = fields_help(RLVRPipelineConfig, width=100)
    assert "``" not in text and ":class:" not in text and ":func:" not in text and ":mod:" not in text
    assert not any(line.endswith("...") for line in text.splitlines())
    assert all(len(line) <= 100 for line in text.splitlines() if line.startswith("      "))
    # trackers, wandb_project and wandb_mode share one description: it is printed under the first only
    lines = text.splitlines()
    assert lines[lines.index("  wandb_mode (Literal['offline', 'online'], default 'offline')") + 1] == "      see trackers"
    assert text.count("experiment trackers that get every metrics.jsonl row") == 1
    assert plain_text("(:class:`dew.experiment_trackers.TrackerOptions`) and :func:`~dew.replay.replay`, ``x``") == \
        "(dew.experiment_trackers.TrackerOptions) and replay, x"
