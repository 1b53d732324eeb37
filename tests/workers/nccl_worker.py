"""One trainer process of tests/test_nccl_push.py's two-process push: every process calls it, one sends.

``nccl_worker.py PROCESS PORT DIRECTORY OUT`` joins a two-process CPU job (gloo) holding
TINY_QWEN3's variables replicated over both processes' devices, and publishes them twice
through a Publication over an NCCLPush. Process 0 holds the mesh's first device: it runs the
NCCL stand-in replica on DIRECTORY (tests/standins.py) and its fabric sender, and the
replica refuses the second update. Process 1's sender raises if it is ever used, so the push
must not send from there. Each writes ``{"after_first", "second", "version"}`` to OUT and
leaves with os._exit (jax.distributed's shutdown barrier would wait for a peer that is gone).
"""

import os
import sys

from publishing import publish_twice, run_and_exit


class NeverSends:
    def __getattr__(self, name):
        raise AssertionError(f"process 1 called the sender's {name}: only the first device's process sends")


def main(process: int, port: str, directory: str, out: str) -> None:
    from dew.sharding import initialize_processes

    initialize_processes(f"127.0.0.1:{port}", 2, process, local_device_count=1)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from standins import Fabric, FabricSender, NCCLVLLMStandIn

    from dew.inference import NCCLPush, Publication
    from dew.models.named_shapes import tiny_qwen3
    from dew.models.pretrained import Pretrained
    from dew.sharding import data_mesh

    model = tiny_qwen3()
    host = jax.tree.map(np.asarray, jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    replicated = NamedSharding(data_mesh(), PartitionSpec())
    variables = jax.tree.map(lambda x: jax.make_array_from_process_local_data(replicated, x), host)
    engine = None
    if process == 0:
        fabric = Fabric()
        engine = NCCLVLLMStandIn(directory, fabric)
        engine.fail = {"route": "/update_weights", "after": 1, "status": 500, "body": {"error": "out of memory"}}
        sender, urls = FabricSender(fabric), [engine.url]
    else:
        sender, urls = NeverSends(), ["http://127.0.0.1:9"]  # never contacted from this process
    publication = Publication(NCCLPush(Pretrained.from_model(model), urls, None, sender=sender))
    publish_twice(publication, variables, out, served=lambda: engine.weight_version if engine else None)


if __name__ == "__main__":
    run_and_exit(main)
