"""One trainer process of tests/test_rollout_servers.py's two-process reload: every process calls the push.

``reload_worker.py PROCESS PORT ENGINE_URL DIRECTORY OUT`` joins a two-process CPU job
(gloo), holds TINY_QWEN3's variables replicated over both processes' devices, and publishes
them twice through one Publication over a SafetensorsReload to the SGLang stand-in at
ENGINE_URL: version 1 (which must land), then version 2 (which the stand-in refuses). It
writes ``{"after_first": version, "second": "Type: message" or null, "version": version}``
to OUT. It leaves with os._exit: a normal exit would run jax.distributed's shutdown
barrier, which waits for a peer that may already be gone.
"""


from publishing import publish_twice, run_and_exit


def main(process: int, port: str, url: str, directory: str, out: str) -> None:
    from dew.sharding import initialize_processes

    initialize_processes(f"127.0.0.1:{port}", 2, process, local_device_count=1)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from dew.inference import Publication, SafetensorsReload
    from dew.models.named_shapes import tiny_qwen3
    from dew.models.pretrained import Pretrained
    from dew.sharding import data_mesh

    model = tiny_qwen3()
    host = jax.tree.map(np.asarray, jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    replicated = NamedSharding(data_mesh(), PartitionSpec())
    variables = jax.tree.map(lambda x: jax.make_array_from_process_local_data(replicated, x), host)
    publication = Publication(SafetensorsReload(Pretrained.from_model(model), directory, [url], "sglang",
                                                served_dtype="float32"))
    publish_twice(publication, variables, out)


if __name__ == "__main__":
    run_and_exit(main)
