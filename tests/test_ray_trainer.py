"""TrainerActor: a 2-process group equals one process on the same global batch; checkpoints resume exactly."""

import functools
import itertools
import sys

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ray import cloudpickle  # noqa: E402

from dew_ray.actors.trainer_actor import TrainerHost, TrainJob, start_trainer_group, step_group  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]
GLOBAL = np.random.default_rng(0).integers(0, 32, (8, 13)).astype(np.int32)

# The build functions below travel to the actors by value: the actors cannot import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def lm_job(output_dir=None, fsdp=1):
    import jax
    import optax

    from dew import Dataset, Trainer, models
    from dew.objectives import LMObjective
    from dew.parallelism import Parallelism

    model = models.build("causal_transformer", vocab_size=32, emb_features=16, num_layers=2, num_heads=2,
                         mlp_features=32, max_seq_len=12)

    def train(partition):
        rows = len(GLOBAL) // partition.count  # each process reads only its own rows of the global batch
        return itertools.repeat({"text": GLOBAL[partition.index * rows:(partition.index + 1) * rows]})

    trainer = Trainer(LMObjective(model, seq_len=12, ema_decay=None), optax.adam(1e-2), key=jax.random.key(0),
                      output_dir=output_dir, progress=False, parallelism=Parallelism(fsdp=fsdp))
    return TrainJob(trainer, Dataset(train=train, batch=8))


def test_a_two_process_group_equals_one_process_on_the_same_global_batch(cluster):
    """The group's two processes hold one FSDP mesh: each holds half of every sharded leaf."""
    job = functools.partial(lm_job, fsdp=2)
    group, started = start_trainer_group(job, processes=2, local_devices=1, num_cpus=0.5)
    assert [(s["process"], s["processes"], s["devices"]) for s in started] == [(0, 2, 2), (1, 2, 2)]
    metrics = step_group(group, 3, timeout=300)
    assert [m["updates"] for m in metrics[0]] == [1, 2, 3] and metrics[0][-1]["loss"] == metrics[1][-1]["loss"]
    # The reference holds two devices in one process: the same split, only the process boundary differs.
    single, _ = start_trainer_group(job, processes=1, local_devices=2, num_cpus=0.5)
    step_group(single, 3, timeout=300)
    reference = ray.get(single[0].snapshot.remote())
    # the snapshot gathers the shards (a collective of the group): process 0 returns the parameters, the others None
    gathered = ray.get([actor.snapshot.remote() for actor in group])
    assert gathered[1] is None
    for got, want in zip(jax_leaves(gathered[0]), jax_leaves(reference), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    ray.get([actor.close.remote() for actor in group])
    for actor in [*group, *single]:
        ray.kill(actor)


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_a_killed_trainer_resumes_from_its_checkpoint(cluster, tmp_path):
    build = functools.partial(lm_job, str(tmp_path / "run"))
    straight = TrainerHost(functools.partial(lm_job, None))  # the plain class, no Ray
    straight.start()
    straight.step(3)
    (first,), _ = start_trainer_group(build, num_cpus=0.5)
    first.step.remote(2)
    assert ray.get(first.save.remote()) == 2
    ray.kill(first)  # the trainer process dies after its checkpoint
    (second,), (started,) = start_trainer_group(build, num_cpus=0.5)
    assert started["restored"] and started["step"] == 2
    assert [m["step"] for m in ray.get(second.step.remote(1))] == [3]
    for got, want in zip(jax_leaves(ray.get(second.snapshot.remote())), jax_leaves(straight.snapshot()), strict=True):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(RuntimeError, match="call start"):
        TrainerHost(build).step()
    ray.kill(second)
