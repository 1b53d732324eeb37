"""Sharded training: the mesh option, the rule table, parity of every objective under FSDP and tensor
parallelism with the replicated run, per-device memory, checkpoints across meshes, rematerialisation."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from conftest import ROOT, run_python
from dew import Trainer, models
from dew.config import ConfigError, load_config
from dew.objectives import LMObjective
from dew.recipes.stage_files import StageRun
from dew_ray.pipelines.rlvr_config import RLVRPipelineConfig
from dew.parallelism import MESH_AXES, MeshOptions, Parallelism, plan_shardings

EIGHT_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def sharded():
    """tests/workers/sharded_training.py on 8 CPU devices: every objective under each mesh, and checkpoints."""
    result = run_python(f"import runpy; runpy.run_path({str(ROOT / 'tests/workers/sharded_training.py')!r}, "
                        "run_name='__main__')", env=EIGHT_DEVICES, timeout=600)
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_parity(runs: dict, tolerance: float = TOLERANCE) -> None:
    base = runs["replicated"]
    assert base["losses"][-1] != base["losses"][0]  # the updates moved the policy
    for name, run in runs.items():
        np.testing.assert_allclose(run["losses"], base["losses"], atol=tolerance, rtol=0, err_msg=name)
        assert sorted(run["params"]) == sorted(base["params"])
        for path, values in base["params"].items():
            np.testing.assert_allclose(run["params"][path], values, atol=tolerance, rtol=0, err_msg=f"{name} {path}")
        assert run["reference_kept"], f"{name}: the frozen reference moved"


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["sft", "dpo", "grpo", "ppo", "flow_grpo"])
def test_five_updates_under_each_mesh_equal_the_replicated_run(sharded, objective):
    runs = {name: run for name, run in sharded[objective].items() if name != "rollout_from_sharded"}
    expected = {"sft": 4, "dpo": 4, "grpo": 4, "ppo": 2, "flow_grpo": 2}[objective]
    assert len(runs) == expected
    assert_parity(runs)


@pytest.mark.slow
def test_the_in_process_rollout_draws_the_same_ids_from_sharded_variables(sharded):
    drawn = sharded["grpo"]["rollout_from_sharded"]
    assert drawn["same_ids"]
    assert drawn["float_difference"] <= TOLERANCE  # log-probabilities: sums in another order


@pytest.mark.slow
def test_the_native_server_serves_sharded_variables_as_they_are(sharded):
    assert sharded["server"] == {"same_ids": True, "requests": 4}


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_each_device_holds_its_share_of_parameters_and_optimizer_state(sharded, objective):
    """Bytes on device 0, read from the arrays' own shards: 1/N of the replicated run's, plus the leaves kept whole
    (the norms' scales: 5 per decoder of 1 layer with QK-norm, in params, Adam's mu and nu, and the reference)."""
    runs = sharded[objective]
    whole = runs["replicated"]["memory"]
    assert whole["undivided"] == []
    per_copy = {"sft": 3, "dpo": 4}[objective]  # params, mu, nu (and DPO's frozen reference)
    assert len(whole["replicated"]) == 5 * per_copy
    norm_bytes = (2 * 16 + 2 * 4 + 16) * 4  # per decoder copy: the layer's 2 norms of 16 and q/k norms of 4, the final
    whole_leaves = 3 * norm_bytes + 4  # in params, mu and nu; and Adam's int32 step count
    sharded_bytes = whole["params_and_optimizer"] - whole_leaves
    for name, ways in (("fsdp 8", 8), ("fsdp 4 x tensor 2", 8), ("data 2 x fsdp 4", 4)):
        memory = runs[name]["memory"]
        assert memory["params_and_optimizer"] == sharded_bytes // ways + whole_leaves, name
        if objective == "dpo":  # the frozen reference is sharded like the policy
            assert memory["ema"] == (whole["ema"] - norm_bytes) // ways + norm_bytes, name


@pytest.mark.slow
def test_a_checkpoint_restores_onto_another_mesh_with_equal_values(sharded):
    """fsdp 8 -> fsdp 4 x tensor 2 -> one device, and each restored state trains on to the same next loss."""
    checkpoints = sharded["checkpoints"]
    assert checkpoints["equal"] == [True, True]
    np.testing.assert_allclose(checkpoints["next_losses"], checkpoints["next_losses"][0], atol=TOLERANCE, rtol=0)
    assert "P('fsdp', 'tensor')" in checkpoints["specs"][1] and "P('tensor', 'fsdp')" in checkpoints["specs"][1]
    assert all("fsdp" not in spec for spec in checkpoints["specs"][2])


def test_the_mesh_option_is_typed_and_checked():
    assert Parallelism().shape(8) == (8, 1, 1)
    assert Parallelism(fsdp=4, tensor=2).shape(8) == (1, 4, 2)
    assert Parallelism(data=2, fsdp=4).shape(8) == (2, 4, 1)
    with pytest.raises(ValueError, match=r"fsdp=3, tensor=1 does not fit 8 device\(s\).*8 is not a multiple of"):
        Parallelism(fsdp=3).shape(8)
    with pytest.raises(ValueError, match="data=2, fsdp=2, tensor=1 does not fit 8 device"):
        Parallelism(data=2, fsdp=2).shape(8)
    with pytest.raises(ConfigError, match="config field 'fsdp' must be an integer >= 1, got 0"):
        Parallelism(fsdp=0)
    with pytest.raises(ConfigError, match="unknown config field 'pipeline'"):
        Parallelism(pipeline=2)
    with pytest.raises(TypeError, match="parallelism must be a dew.parallelism.Parallelism"):
        Trainer(LMObjective(tiny(), seq_len=4), optax.sgd(1.0), key=jax.random.key(0), parallelism={"fsdp": 8})
    with pytest.raises(ValueError, match="fsdp=2, tensor=1 does not fit 1 device"):
        Trainer(LMObjective(tiny(), seq_len=4), optax.sgd(1.0), key=jax.random.key(0), parallelism=Parallelism(fsdp=2))


def tiny(**options):
    return models.build("causal_transformer", vocab_size=32, emb_features=16, num_layers=1, num_heads=4,
                        num_kv_heads=2, mlp_features=24, max_seq_len=8, **options)


def test_the_rule_table_shards_projections_by_column_and_row_and_names_what_it_leaves_whole():
    mesh = AbstractMesh((1, 4, 2), MESH_AXES)
    variables = jax.eval_shape(tiny(tie_embeddings=False).init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    tree = {"params": variables, "opt": {"mu": variables, "count": jax.ShapeDtypeStruct((), jnp.int32)},
            "head": {"kernel": jax.ShapeDtypeStruct((16, 3), jnp.float32)}}
    plan = plan_shardings(tree, mesh)
    layer = "params/params/layers_0"
    assert plan.specs[f"{layer}/self_attn/q_proj/kernel"] == PartitionSpec("fsdp", "tensor")  # column split
    assert plan.specs[f"{layer}/self_attn/o_proj/kernel"] == PartitionSpec("tensor", "fsdp")  # row split
    assert plan.specs[f"{layer}/mlp/up_proj/kernel"] == PartitionSpec("fsdp", "tensor")
    assert plan.specs[f"{layer}/mlp/down_proj/kernel"] == PartitionSpec("tensor", "fsdp")
    assert plan.specs["params/params/embed_tokens/embedding"] == PartitionSpec("tensor", "fsdp")
    assert plan.specs["params/params/lm_head/kernel"] == PartitionSpec("fsdp", "tensor")
    # Adam's moments sit at other paths with the same ending, and are split alike
    assert plan.specs["opt/mu/params/layers_0/mlp/down_proj/kernel"] == PartitionSpec("tensor", "fsdp")
    assert plan.specs["opt/count"] == PartitionSpec()
    assert f"{layer}/input_layernorm/scale" in plan.replicated
    # a leaf no rule names takes the default: its largest dimension fsdp divides
    assert plan.defaulted == ("head/kernel",) and plan.specs["head/kernel"] == PartitionSpec("fsdp", None)
    assert plan.undivided == ()
    odd = plan_shardings({"w": jax.ShapeDtypeStruct((3, 5), jnp.float32)}, mesh)
    assert odd.specs["w"] == PartitionSpec() and odd.undivided == (("w", 1, "fsdp"),)
    with pytest.raises(ValueError, match=r"the sharding rule for 'bad/q_proj/kernel' names 2 axes .* shape \(4,\)"):
        plan_shardings({"bad": {"q_proj": {"kernel": jax.ShapeDtypeStruct((4,), jnp.float32)}}}, mesh)
    with pytest.raises(ValueError, match="names the logical axis 'expert'"):
        plan_shardings({"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}, mesh, rules=((r"w$", ("expert", None)),))


def test_rematerialised_layers_give_the_same_update_and_their_policy_is_checked():
    batch = {"text": np.random.default_rng(0).integers(0, 32, (4, 9)).astype(np.int32)}
    params = {}
    for remat in ("none", "full", "dots"):
        trainer = Trainer(LMObjective(tiny(remat=remat), seq_len=8, ema_decay=None), optax.adamw(1e-3, eps=1e-5),
                          key=jax.random.key(0), progress=False)
        state, _ = trainer.step(trainer.initial_state(), batch)
        params[remat] = jax.tree.leaves(jax.device_get(state.params))
    for remat in ("full", "dots"):
        for a, b in zip(params[remat], params["none"], strict=True):
            np.testing.assert_allclose(a, b, atol=TOLERANCE, rtol=0)
    with pytest.raises(ValueError, match=r"remat must be one of \('none', 'full', 'dots'\), got 'some'"):
        tiny(remat="some")


def test_step_memory_reads_xlas_analysis_without_allocating_the_state():
    trainer = Trainer(LMObjective(tiny(), seq_len=8, ema_decay=None), optax.adamw(1e-3), key=jax.random.key(0),
                      progress=False)
    memory = trainer.step_memory({"text": jax.ShapeDtypeStruct((4, 9), jnp.int32)})
    parameters = sum(leaf.size for leaf in jax.tree.leaves(jax.eval_shape(trainer.initial_state).params)) * 4
    assert memory["arguments"] >= 3 * parameters  # params, Adam's mu and nu
    assert memory["peak"] == memory["arguments"] + memory["outputs"] + memory["temporaries"] - memory["aliased"]
    assert memory["aliased"] >= 3 * parameters  # the state is donated: its outputs reuse its buffers



@pytest.mark.slow
def test_gathering_sharded_weights_for_publication_holds_one_copy_plus_one_leaf():
    """collective_host (what SafetensorsReload, NCCLPush and the trainers' snapshots gather through) fetches an
    FSDP-sharded tree leaf by leaf: the host's peak is the tree's bytes plus at most its largest leaf's."""
    result = run_python("""
import json, tracemalloc
import jax, numpy as np
from dew.parallelism import Parallelism, plan_shardings
from dew.sharding import collective_host
mesh = Parallelism(fsdp=8).mesh()
shapes = {"embed_tokens": {"embedding": (4096, 256)}, "layers_0": {"mlp": {"up_proj": {"kernel": (256, 1024)}}},
          "norm": {"scale": (256,)}, "lm_head": {"kernel": (256, 512)}}
tree = jax.tree.map(lambda shape: np.ones(shape, np.float32), shapes, is_leaf=lambda x: isinstance(x, tuple))
plan = plan_shardings(tree, mesh)
sharded = jax.tree.map(jax.device_put, tree, plan.shardings)
tracemalloc.start()
host = collective_host(sharded)
current, peak = tracemalloc.get_traced_memory()
total = sum(leaf.nbytes for leaf in jax.tree.leaves(tree))
largest = max(leaf.nbytes for leaf in jax.tree.leaves(tree))
equal = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(tree)))
print(json.dumps({"peak": peak, "total": total, "largest": largest, "equal": equal}))
""", env=EIGHT_DEVICES)
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["equal"]
    assert out["largest"] == 4096 * 256 * 4
    assert out["total"] <= out["peak"] <= out["total"] + out["largest"] + 64 * 1024, out  # + 64 KiB of bookkeeping


def test_pipeline_configs_take_the_mesh_and_remat_options():
    config = load_config(RLVRPipelineConfig, None, ["fsdp=4", "tensor=2", "remat=full"])
    assert config.parallelism() == Parallelism(fsdp=4, tensor=2)
    assert config.rematerialised(tiny()).remat == "full"
    assert StageRun(model="m", data="d.jsonl", steps=1, fsdp=2).parallelism() == Parallelism(fsdp=2)
    with pytest.raises(ConfigError, match=r"cannot read 'all' as config field 'remat' \(one of 'none', 'full' or 'dots'\)"):
        load_config(RLVRPipelineConfig, None, ["remat=all"])
    with pytest.raises(ValueError, match="remat='dots' needs a decoder with layer rematerialisation .* SimpleDiT"):
        MeshOptions(remat="dots").rematerialised(models.SimpleDiT(output_channels=1, patch_size=2, emb_features=8,
                                                                   num_layers=1, num_heads=2, mlp_ratio=2))
