"""GRPO on Harbor tasks: each sample one Harbor trial whose agent calls vLLM through rllm-model-gateway.

You run (dew attaches to them, it starts none):

- vLLM replicas on the policy's Hugging Face directory, launched on the directory this
  script publishes into (``--policy``; first written by ``SafetensorsReload.write``), with
  ``VLLM_SERVER_DEV_MODE=1``, on a network only the trainer reaches;
- rllm-model-gateway in front of them on loopback (the spec's config: ``store_worker:
  memory``, ``sync_traces: true``, ``health_check_interval: 60``), warmed as the spec says;
- Harbor (``pip install harbor`` in a Python >= 3.12 environment; ``--harbor`` is its
  executable) with a container engine, and a folder of Harbor tasks (``--tasks``, one
  task directory each) whose agent phase runs with ``network_mode = "allowlist"``.

The script starts the path-restricted SessionProxy in front of the gateway (on
``--proxy-host``, the address sandboxes reach) and gives Harbor's agents that proxy only
(``--allow-agent-host``). Then it trains: a RolloutScheduler over a HarborSource (one trial
per sample, ``--trials`` at once), the policy published by SafetensorsReload and stamped on
the gateway when it has ``/admin/weight_version`` (rllm-model-gateway 0.1.0 does not; then
each call carries the version served at its submission).

    python examples/train_harbor.py --policy /models/qwen3-0.6b --engine http://10.0.0.5:8011 \\
        --gateway http://127.0.0.1:9090 --proxy-host 172.17.0.1 --tasks ./tasks --harbor ~/harbor/bin/harbor
"""

from __future__ import annotations

import argparse
import itertools
import os

import jax
import numpy as np
import optax

from dew.data import Dataset
from dew.inference import Publication, SafetensorsReload
from dew.inference.wire import EngineError
from dew.models.pretrained import Pretrained
from dew.collection.scheduler import RolloutScheduler
from dew.objectives.grpo import GRPOObjective
from dew.collection.harbor_source import HarborCLI, HarborSource
from dew.inference.gateway import Gateway, GatewayError
from dew.inference.session_proxy import SessionProxy
from dew.records.session_records import Task
from dew.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", required=True, help="the Hugging Face directory the vLLM replicas launched on")
    parser.add_argument("--engine", action="append", required=True, help="a vLLM replica's root URL (repeatable)")
    parser.add_argument("--model", default=None, help="the name the replicas serve (default: the policy folder's)")
    parser.add_argument("--gateway", required=True, help="the gateway's root as the trainer reaches it")
    parser.add_argument("--proxy-host", default="127.0.0.1", help="where the sandboxes reach the session proxy")
    parser.add_argument("--tasks", required=True, help="a folder of Harbor task directories")
    parser.add_argument("--harbor", default="harbor", help="the Harbor executable")
    parser.add_argument("--agent", default="terminus-2")
    parser.add_argument("--harbor-env", default=None, help="Harbor's --env (default: docker; on a machine without "
                        "containers: dew_harbor.bubblewrap:BubblewrapEnvironment, with this checkout on PYTHONPATH)")
    parser.add_argument("--trials", type=int, default=8, help="Harbor trials at once")
    parser.add_argument("--groups", type=int, default=4, help="trials per task (the GRPO group)")
    parser.add_argument("--tasks-per-step", type=int, default=2)
    parser.add_argument("--width", type=int, default=8192, help="the packed row width in ids")
    parser.add_argument("--rows-per-session", type=int, default=2, help="packed rows a session may take: a chat "
                        "harness re-renders its history, so its calls often pack as separate chains")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output-dir", default="runs/harbor")
    args = parser.parse_args(argv)

    names = sorted(entry.name for entry in os.scandir(args.tasks) if entry.is_dir())
    if not names:
        parser.error(f"{args.tasks} holds no Harbor task directories")
    pretrained = Pretrained.from_directory(args.policy)
    model, params = pretrained.model(), pretrained.load()
    model_name = args.model or os.path.basename(os.path.normpath(args.policy))
    gateway_url = args.gateway.rstrip("/")
    proxy = SessionProxy(gateway_url, host=args.proxy_host)
    gateway = Gateway(gateway_url, sandbox_url=proxy.url)
    try:
        gateway.stamp(0)
        stamp = gateway.stamp
    except GatewayError as error:
        print(f"publishing without version stamps: {error}")
        stamp = None
    served = Publication(SafetensorsReload(pretrained, args.policy, args.engine, "vllm"), version=0, stamp=stamp)
    harbor = HarborCLI(args.tasks, os.path.join(args.output_dir, "trials"), harbor=args.harbor, agent=args.agent,
                       allow_hosts=[args.proxy_host], args=["--env", args.harbor_env] if args.harbor_env else [])
    source = HarborSource(gateway, harbor=harbor, model=model_name, trials=args.trials, served=served)

    objective = GRPOObjective(model, seq_len=args.width - 1, pretrained=params, behavior_importance=2.0)
    scheduler = RolloutScheduler(
        objective, source, served, width=args.width, rows=args.tasks_per_step * args.groups * args.rows_per_session,
        tasks=lambda batch: [Task(names[i], {"harbor_task": names[i]}) for i in batch["task_id"].tolist()],
        groups=args.groups, max_lag=1, ahead=1, log=lambda record: print(record.metrics))
    per_step = args.tasks_per_step
    data = Dataset(train=lambda partition: (
        {"task_id": np.arange(step * per_step, (step + 1) * per_step) % len(names)} for step in itertools.count()))
    trainer = Trainer(objective, optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-6)),
                      key=jax.random.key(0), rollout=scheduler, output_dir=args.output_dir, checkpoint_every=5)
    try:
        state = trainer.fit(scheduler.tasks(data), steps=args.steps)
        print(f"trained {int(state.updates)} updates on {len(names)} Harbor tasks; served version {served.version}")
    except EngineError as error:
        print(f"stopped: {error}")
        return 1
    finally:
        scheduler.close()
        source.close()
        proxy.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
