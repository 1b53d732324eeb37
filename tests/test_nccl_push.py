"""NCCLPush: the real libnccl's device-free calls, and the push against vLLM's weight-transfer routes.

The binding loads the ``libnccl.so.2`` of the ``nvidia-nccl-cu12`` wheel (a dev dependency)
and runs the calls that need no GPU. A broadcast needs CUDA GPUs on both sides, so the
HTTP sequence, the chunking and the failures run against tests/standins.py's
NCCLVLLMStandIn, which receives the chunks over an in-process Fabric exactly as vLLM
0.32's packed consumer cuts them and then serves what arrived, so the landing check
compares real numbers. The real CPU vLLM is asked too: it has no NCCL, and the push says so.
"""

import importlib.metadata
import shutil

import numpy as np
import pytest
from standins import Fabric, FabricSender, NCCLVLLMStandIn

from dew.inference import EngineError, NCCLPush, Publication
from dew.inference.landing import halved_down_proj
from dew.inference.nccl import NCCLError, NCCLLibrary, NCCLSender, bundled_library, version_name
from dew.inference.nccl_push import chunks
from dew.sampling import Sampling

SEQUENCE = ["/pause?mode=wait", "/start_weight_update", "/update_weights", "/finish_weight_update",
            "/reset_prefix_cache", "/update_weight_version", "/resume"]


@pytest.fixture(scope="module")
def library():
    path = bundled_library()
    assert path is not None, "the nvidia-nccl-cu12 dev dependency ships libnccl.so.2"
    return NCCLLibrary(path)


def test_the_real_library_reports_its_version_unique_ids_and_errors(library):
    assert library.version() == importlib.metadata.version("nvidia-nccl-cu12") == "2.32.3"
    assert version_name(library.version_code()) == library.version() and version_name(21903) == "2.19.3"
    first, second = library.unique_id(), library.unique_id()
    assert len(first) == len(second) == 128 and first != second
    assert "invalid usage" in library.error_string(5) and library.error_string(0) == "no error"
    with pytest.raises(ValueError, match="128 bytes, got 3"):
        library.init_rank(2, b"abc", 0)
    with pytest.raises(FileNotFoundError, match="no NCCL library at /nowhere/libnccl.so.2.*engine's own"):
        NCCLLibrary("/nowhere/libnccl.so.2")


def test_a_sender_refuses_a_trainer_without_a_cuda_device(library):
    # This machine's JAX runs on CPU: the sender says what it needs before any NCCL call.
    with pytest.raises(NCCLError, match="sends from a CUDA GPU; the trainer's first device is"):
        NCCLSender(library).join(library.unique_id(), 2)


def test_chunks_close_once_they_pass_the_buffer_as_vllms_consumer_cuts_them():
    sizes = {"a": 40, "b": 40, "c": 30, "d": 100, "e": 10}
    tensors = {name: np.zeros(size, np.uint8) for name, size in sizes.items()}
    assert list(chunks(tensors, 64)) == [["a", "b"], ["c", "d"], ["e"]]
    assert list(chunks(tensors, 1000)) == [["a", "b", "c", "d", "e"]]
    assert list(chunks(tensors, 1)) == [["a"], ["b"], ["c"], ["d"], ["e"]]


@pytest.fixture
def replicas(tiny_qwen3, tmp_path):
    """Two NCCL stand-in replicas on copies of the launch weights, sharing one fabric, and a sender on it."""
    fabric = Fabric()
    engines = []
    for index in range(2):
        directory = tmp_path / f"replica-{index}"
        shutil.copytree(tiny_qwen3[2], directory)
        engines.append(NCCLVLLMStandIn(directory, fabric))
    yield engines, FabricSender(fabric)
    for engine in engines:
        engine.close()


def test_a_push_runs_vllms_sequence_on_every_replica_and_lands(replicas, tiny_qwen3):
    pretrained, variables, _ = tiny_qwen3
    engines, sender = replicas
    push = NCCLPush(pretrained, [engine.url for engine in engines], None, sender=sender, buffer_bytes=64 * 1024)
    publication = Publication(push)
    halved = halved_down_proj(variables)
    publication.load(halved, 1)
    exported = pretrained.export(halved, "bfloat16")
    for engine in engines:
        paths = [path for path, _ in engine.calls]
        assert paths[:2] == ["/server_info?config_format=json", "/init_weight_transfer_engine"]
        assert paths[2:9] == SEQUENCE and paths[9:] == ["/v1/models", "/v1/completions"]  # then the landing probe
        init = dict(engine.calls[1][1]["init_info"])
        init.pop("nccl_unique_id_b64")
        assert init == {"rank_offset": 1, "world_size": 2, "packed": True, "packed_buffer_size_bytes": 64 * 1024,
                        "packed_num_buffers": 2}
        update = engine.calls[4][1]["update_info"]
        assert update["names"] == list(exported) and set(update["dtype_names"]) == {"bfloat16"}
        assert update["shapes"] == [list(value.shape) for value in exported.values()]
        for name, value in exported.items():  # what arrived is what export wrote, bit for bit
            np.testing.assert_array_equal(engine._received[name].view(np.uint16), value.view(np.uint16))
        assert engine.weight_version == "1" and not engine.paused
    assert engines[0].unique_id != engines[1].unique_id  # one group per replica
    largest = max(value.nbytes for value in exported.values())
    assert len(sender.chunks) == len(list(chunks(exported, 64 * 1024))) > 2
    assert max(sender.chunks) <= 64 * 1024 + largest and sum(sender.chunks) == sum(v.nbytes for v in exported.values())
    assert set(push.published) == {engine.url for engine in engines}
    assert max(push.published.values()) < 0.1  # bfloat16's landing tolerance

    publication.load(variables, 2)  # the groups stay open: no second rendezvous
    for engine in engines:
        assert [path for path, _ in engine.calls[11:18]] == SEQUENCE and engine.weight_version == "2"
    push.close()
    assert len(sender.aborted) == 2
    with pytest.raises(EngineError, match="cannot push version 3: the push was closed; restart"):
        publication.load(variables, 3)
    assert publication.version == 2


def test_a_replica_set_aside_is_left_out_and_rejoins_through_the_next_push(replicas, tiny_qwen3):
    """An EnginePool with a timeout sets a silent replica aside: the push leaves it out (no group opened, nothing
    asked), and since a push keeps no weights to catch one replica up, rejoin puts it back in the next push and says
    True once it reports the published version."""
    pretrained, variables, _ = tiny_qwen3
    engines, sender = replicas
    push = NCCLPush(pretrained, [engine.url for engine in engines], None, sender=sender, buffer_bytes=64 * 1024)
    publication = Publication(push)
    publication.set_aside(engines[1].url)
    publication.load(halved_down_proj(variables), 1)
    assert engines[0].weight_version == "1" and engines[1].calls == [] and list(push.groups) == [engines[0].url]
    assert set(push.published) == {engines[0].url}
    assert not publication.rejoin(engines[1].url)  # it still serves its launch weights: in the next push, not yet back
    publication.load(variables, 2)  # its group opens at this push
    assert engines[0].weight_version == engines[1].weight_version == "2" and len(push.groups) == 2
    assert publication.rejoin(engines[1].url)
    with pytest.raises(ValueError, match="http://nowhere is not one of this push's replicas"):
        publication.set_aside("http://nowhere")
    push.close()
    with pytest.raises(TypeError, match="push \\(function\\) has no replicas to set_aside"):
        Publication(lambda variables, version: None).set_aside(engines[0].url)


def test_a_replica_started_again_elsewhere_gets_a_group_of_its_own_at_the_next_push(replicas, tiny_qwen3,
                                                                                      tmp_path):
    """A replica whose host started it again answers at a new address (an EnginePool with locate calls move): its old
    group is aborted (the engine's side went with its process), it stays aside until it rejoins, and the push that
    includes it opens a new group with it. A later version rejoins only where this process pushed nothing (another
    process publishes)."""
    pretrained, variables, _ = tiny_qwen3
    engines, sender = replicas
    push = NCCLPush(pretrained, [engine.url for engine in engines], None, sender=sender, buffer_bytes=64 * 1024)
    publication = Publication(push)
    publication.load(halved_down_proj(variables), 1)
    old_group = push.groups[engines[0].url]
    shutil.copytree(tiny_qwen3[2], tmp_path / "again")
    again = NCCLVLLMStandIn(tmp_path / "again", sender.fabric)
    try:
        publication.move(engines[0].url, again.url)
        assert push.engines == [again.url, engines[1].url] and push.aside == {again.url}
        assert old_group not in push.groups.values() and sender.aborted == [sender._ids[old_group]]
        assert engines[0].url not in push.published
        assert not publication.rejoin(again.url)  # it serves its launch weights: in the next push, not back yet
        publication.load(variables, 2)
        assert again.weight_version == engines[1].weight_version == "2" and again.unique_id is not None
        assert publication.rejoin(again.url) and set(push.groups) == {again.url, engines[1].url}
        again.weight_version = "3"
        assert not push.rejoin(again.url, 2)  # this process pushed 2: it takes version 2 and no other
        follower = NCCLPush(pretrained, [again.url, engines[1].url], None, sender=sender)
        assert follower.rejoin(again.url, 2)  # a process that pushed nothing takes the later one another pushed
        with pytest.raises(ValueError, match=f"{engines[1].url} is already one of this push's replicas"):
            publication.move(again.url, engines[1].url)
    finally:
        push.close()
        again.close()


def test_a_version_mismatch_or_an_engine_without_nccl_is_refused_before_any_group(replicas, tiny_qwen3):
    pretrained, variables, _ = tiny_qwen3
    engines, sender = replicas
    engines[1].nccl = "2.27.3"
    push = NCCLPush(pretrained, [engine.url for engine in engines], None, sender=sender)
    with pytest.raises(EngineError, match=r"runs NCCL 2\.27\.3 and the trainer's library is NCCL 2\.32\.3"):
        push(variables, 1)
    engines[1].nccl = None
    with pytest.raises(EngineError, match="reports no NCCL wheel .*SafetensorsReload"):
        push(variables, 1)
    assert all("/init_weight_transfer_engine" not in [p for p, _ in engine.calls] for engine in engines)
    engines[1].nccl = "2.32.3"
    push(variables, 1)  # nothing was joined, so the push can still open its groups
    assert all(engine.weight_version == "1" for engine in engines)


def test_a_refused_update_aborts_the_groups_and_leaves_the_replicas_paused(replicas, tiny_qwen3):
    pretrained, variables, _ = tiny_qwen3
    engines, sender = replicas
    publication = Publication(NCCLPush(pretrained, [engine.url for engine in engines], None, sender=sender))
    engines[0].fail = {"route": "/update_weights", "status": 400, "body": {"detail": "unknown parameter"}}
    with pytest.raises(EngineError, match=r"update_weights: answered HTTP 400 \(.*unknown parameter"):
        publication.load(variables, 1)
    assert publication.version == 0 and all(engine.paused for engine in engines)
    assert len(sender.aborted) == 2 and all(engine.weight_version == "default" for engine in engines)
    with pytest.raises(EngineError, match="cannot push version 2: the transfer of version 1 failed .*restart"):
        publication.load(variables, 2)


def test_a_reset_without_success_fails_the_push_and_keeps_the_replica_paused(replicas, tiny_qwen3):
    pretrained, variables, _ = tiny_qwen3
    engines, sender = replicas
    publication = Publication(NCCLPush(pretrained, [engines[0].url], None, sender=sender))
    engines[0].fail = {"route": "/reset_prefix_cache", "status": 200, "body": {"success": False}}
    with pytest.raises(EngineError, match=r"reset_prefix_cache answered \{'success': False\}.*stays paused"):
        publication.load(variables, 1)
    assert publication.version == 0 and engines[0].paused and engines[0].weight_version == "default"
    publication.load(variables, 1)  # the transfer itself finished, so the group is still good
    assert publication.version == 1 and not engines[0].paused


def test_the_real_cpu_vllm_has_no_nccl_and_the_push_says_so(vllm_engine, tiny_qwen3, library):
    pretrained, variables, _ = tiny_qwen3
    push = NCCLPush(pretrained, [vllm_engine.url], library.path)
    with pytest.raises(EngineError, match=f"{vllm_engine.url}: the engine reports no NCCL wheel"):
        push(variables, 1)


def test_the_pipeline_publishes_by_nccl_only_with_gpus_on_both_sides(tiny_qwen3, library):
    from dew_ray.actors.vllm_engine_actor import vllm_rollouts
    from dew_ray.pipelines.rlvr_config import load_config
    from dew_ray.pipelines.rlvr_job import engine_args

    with pytest.raises(ValueError, match=r"engine_push' = 'nccl' needs engine='vllm' and GPUs on both sides"):
        load_config(engine="vllm", engine_push="nccl", server_gpus=1.0)
    config = load_config("cluster_configs/rlvr-vllm-gpu.toml")
    assert config.engine_push == "nccl" and config.trainer_gpus == 1.0
    assert engine_args(config)[-2:] == ["--weight-transfer-config", '{"backend": "nccl"}']
    pool = vllm_rollouts(tiny_qwen3[0], "/unused", ["http://127.0.0.1:1"], Sampling(), nccl_library=library.path)
    push = pool.servers[0].weights.push
    assert isinstance(push, NCCLPush) and push.sender.library.path == library.path


def test_on_two_trainer_processes_the_first_devices_process_sends_and_both_agree(tiny_qwen3, tmp_path):
    import json

    from conftest import two_processes

    directory = tmp_path / "policy"
    shutil.copytree(tiny_qwen3[2], directory)
    outs = [tmp_path / f"nccl-{p}.json" for p in (0, 1)]
    two_processes("nccl_worker.py", lambda p: [str(directory), str(outs[p])])
    first, second = (json.loads(out.read_text()) for out in outs)
    assert first["after_first"] == second["after_first"] == 1 and first["served"] == "1"
    assert first["second"].startswith("EngineError:") and "out of memory" in first["second"]
    assert second["second"].startswith("RuntimeError: the NCCL push of version 2 failed on process 0 of 2")
    assert first["version"] == second["version"] == 1
