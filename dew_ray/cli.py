"""The ``dew-ray`` command.

``dew-ray rlvr`` is the main job: asynchronous RLVR on the built-in verifiable tasks
(:mod:`dew_ray.pipelines.rlvr`) on a local Ray cluster it starts (or the cluster at
``--address`` / ``RAY_ADDRESS``), with a progress bar and a final summary. ``dew-ray
sft-demo`` trains the tiny built-in story decoder in this process and prints the
validation loss before and after. ``dew-ray serve`` serves a decoder (a Hugging Face
checkpoint, or the story decoder after a short training) through the native
continuous-batching server's OpenAI-compatible HTTP front. ``dew-ray sft``, ``dew-ray dpo``
and ``dew-ray grpo`` train one stage in this process on a Hugging Face model directory and a
data file, as TRL's CLI does (:mod:`dew.recipes.stage_files`); ``dew-ray chain`` runs a chain
of them on Ray (:mod:`dew_ray.pipelines.chain`). ``dew-ray fleet RUN_DIR --add N`` (or
``--remove N``) asks the driver of a running ``dew-ray rlvr`` to change its rollout fleet
before its next update and prints the outcome (:mod:`dew_ray.pipelines.rlvr_fleet`). ``dew-ray
replay RUN_DIR`` trains a finished (or stopped) ``dew-ray rlvr`` run again from its record, in
this process without Ray, and reports whether every update's parameters equal the run's
(:mod:`dew_ray.pipelines.rlvr_replay`).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path


def sft_demo(args: argparse.Namespace) -> int:
    import jax
    import optax

    from dew import Trainer
    from dew.data.stories import story_dataset, story_decoder, story_tokenizer
    from dew.objectives import LMObjective

    started = time.perf_counter()
    tokenizer = story_tokenizer()
    data = story_dataset(tokenizer, seq_len=args.seq_len, batch=args.batch)
    model = story_decoder(len(tokenizer), max_seq_len=args.seq_len)
    trainer = Trainer(
        LMObjective(model, seq_len=args.seq_len, ema_decay=None),
        optax.adamw(args.learning_rate),
        key=jax.random.key(args.seed),
        output_dir=args.output_dir,
        checkpoint_every=args.steps if args.output_dir else None,
    )
    print(
        f"dew-ray sft-demo: {len(tokenizer)}-token BPE, {data.records} packed rows of {args.seq_len + 1} ids, "
        f"batch {args.batch}, {jax.device_count()} device(s)"
    )
    before = trainer.evaluate(trainer.initial_state(), data)
    state = trainer.fit(data, steps=args.steps, log_every=args.log_every)
    after = trainer.evaluate(state, data)
    seconds = time.perf_counter() - started
    print(
        f"validation loss {before['loss']:.4f} -> {after['loss']:.4f} "
        f"(perplexity {before['perplexity']:.1f} -> {after['perplexity']:.2f}) "
        f"after {int(state.updates)} updates in {seconds:.1f} s"
    )
    if not after["loss"] < before["loss"]:
        print("error: validation loss did not fall", file=sys.stderr)
        return 1
    return 0


def serve(args: argparse.Namespace) -> int:
    from dew.inference.http import check_exposure

    try:  # before the model is built or trained: a refused address fails at once
        keys = check_exposure(args.host, args.api_key or [k for k in [os.environ.get("VLLM_API_KEY")] if k],
                              args.unauthenticated)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    import jax
    import jax.numpy as jnp
    import optax

    from dew.inference import NativeRolloutServer, OpenAIFront, Server
    from dew.sampling import Sampling

    if args.checkpoint:
        from transformers import AutoTokenizer

        from dew.models.pretrained import load_pretrained

        model, variables = load_pretrained(args.checkpoint)
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
        except (OSError, ValueError):
            tokenizer = None  # a checkpoint without tokenizer files serves token ids only
        name = args.checkpoint
    else:
        from dew import Trainer
        from dew.data.stories import story_dataset, story_decoder, story_tokenizer
        from dew.objectives import LMObjective

        tokenizer = story_tokenizer()
        model = story_decoder(len(tokenizer), max_seq_len=args.capacity)
        width = min(64, args.capacity)
        data = story_dataset(tokenizer, seq_len=width, batch=16)
        trainer = Trainer(LMObjective(model, seq_len=width, ema_decay=None), optax.adamw(3e-3), key=jax.random.key(0))
        variables = trainer.fit(data, steps=args.train_steps, log_every=args.train_steps).params
        name = "dew-stories"
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, eos_id=eos)
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    blocks = {} if args.block_size is None else {"block_size": args.block_size}
    server = Server(model, variables, sampling, slots=args.slots, capacity=args.capacity, dtype=dtype, lanes=args.lanes,
                    **blocks)
    with NativeRolloutServer(server) as rollout, OpenAIFront(rollout, tokenizer, args.host, args.port, name,
                                                             api_keys=keys,
                                                             unauthenticated=args.unauthenticated) as front:
        guard = f"; API key required on /v1 ({len(keys)} key(s))" if keys else ""
        print(f"dew-ray serve: {name} at {front.url}/v1 ({args.slots} slots of {args.capacity}){guard}; Ctrl-C stops",
              flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            print("stopped")
    return 0


def rlvr(args: argparse.Namespace) -> int:
    from dew_ray.pipelines import rlvr as pipeline

    overrides = list(args.set)
    if args.run_dir is None and args.config is None and not any(o.startswith("run_dir=") for o in overrides):
        args.run_dir = time.strftime("runs/rlvr-%Y%m%d-%H%M%S")  # a fresh run each time unless asked to resume
    if args.run_dir is not None:
        overrides.append(f"run_dir={args.run_dir}")
    if args.steps is not None:
        overrides.append(f"steps={args.steps}")
    try:
        config = pipeline.load_config(args.config, overrides)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"dew-ray rlvr: {config.steps} GRPO updates of {config.tasks_per_step} tasks x {config.samples} samples, "
          f"{config.servers} rollout server(s), {config.sandbox_runners} sandbox runner(s)", flush=True)
    try:
        summary = pipeline.run(config, args.address)
    except pipeline.PreflightError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    pipeline.print_summary(summary)
    return 0


APPLYING = 330.0  # seconds a taken fleet request may take: an added server's placement waits up to 300 s


def fleet(args: argparse.Namespace) -> int:
    from dew_ray.pipelines.rlvr_fleet import FleetRequest, ask, outcome, withdraw

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.json").exists():
        print(f"error: {run_dir} is not the directory of a dew-ray rlvr run (it has no config.json)", file=sys.stderr)
        return 2
    if (run_dir / "summary.json").exists():
        print(f"error: the run in {run_dir} has finished (summary.json): its fleet no longer changes", file=sys.stderr)
        return 2
    try:
        request = FleetRequest(change="add" if args.add is not None else "remove",
                               count=args.add if args.add is not None else args.remove, drain=args.drain)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    ident = ask(run_dir, request)
    if args.wait == 0:
        print(f"asked: {request.change} {request.count} rollout server(s) (request {ident}); the driver applies it "
              f"before its next update and logs the outcome in {run_dir / 'fleet.jsonl'}")
        return 0
    until = time.monotonic() + args.wait
    while (entry := outcome(run_dir, ident)) is None:
        if time.monotonic() >= until and withdraw(run_dir, ident):
            print(f"error: the driver did not take the request within {args.wait:g} s (is the run training?); "
                  "withdrawn", file=sys.stderr)
            return 3
        if time.monotonic() >= until + APPLYING:  # taken, but a driver that died holding it answers nothing
            print(f"error: the driver took request {ident} but logged no outcome within {APPLYING:g} s; a rerun of "
                  f"the run applies it (see {run_dir / 'fleet.jsonl'})", file=sys.stderr)
            return 3
        time.sleep(0.5)  # past the wait, a request the driver took is being applied: its outcome is coming
    if entry["change"] == "refused":
        print(f"refused after update {entry['step']}: {entry['refused']}", file=sys.stderr)
        return 1
    print(f"after update {entry['step']}: {entry['change']} {', '.join(entry['servers'])}; the fleet has "
          f"{entry['size']} rollout server(s)")
    return 0


def replay(args: argparse.Namespace) -> int:
    from dew.update_record import RecordError
    from dew_ray.pipelines.rlvr_replay import replay_run

    try:
        report = replay_run(args.run_dir, until=args.until)
    except RecordError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(report.describe())
    return 0 if report.identical else 1


def stage(args: argparse.Namespace) -> int:
    from dew.config import load_config
    from dew.recipes.stage_files import StageRun, run_stage

    overrides = list(args.set)
    for name in ("model", "data", "output_dir", "steps"):
        if getattr(args, name) is not None:
            overrides.append(f"{name}={getattr(args, name)}")
    if args.output_dir is None and args.config is None and not any(o.startswith("output_dir=") for o in overrides):
        overrides.append(time.strftime(f"output_dir=runs/{args.kind}-%Y%m%d-%H%M%S"))
    try:
        config = load_config(StageRun, args.config, overrides, table=args.kind)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"dew-ray {args.kind}: {config.steps} steps of {config.batch} rows on {config.model} from {config.data}; "
          f"writing {config.output_dir}", flush=True)
    started = time.perf_counter()
    try:
        state, policy = run_stage(config, args.kind)
    except (ValueError, OSError, TypeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{args.kind}: {int(state.updates)} updates in {time.perf_counter() - started:.1f} s; checkpoints and "
          f"metrics.jsonl in {Path(config.output_dir) / args.kind}, the policy in {policy}")
    return 0


def chain(args: argparse.Namespace) -> int:
    from dew_ray.pipelines import chain as pipeline

    return pipeline.main(["--config", args.config, *(f"--set={o}" for o in args.set),
                          *(["--address", args.address] if args.address else [])])


def _rlvr_config():
    from dew_ray.pipelines.rlvr_config import RLVRPipelineConfig

    return RLVRPipelineConfig


def _stage_config():
    from dew.recipes.stage_files import StageRun

    return StageRun


def _chain_config():
    from dew_ray.pipelines.chain import ChainConfig

    return ChainConfig


class FieldsHelp(argparse.Action):
    """``-h``/``--help`` that lists the command's config fields (types, defaults, one line each), generated from
    its pydantic model; the model is imported only when help is asked for (it pulls in JAX)."""

    def __init__(self, option_strings, dest, config, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show this help and the "
                         "config fields, then exit")
        self.config = config

    def __call__(self, parser, namespace, values, option_string=None):
        from dew.config import fields_help

        parser.epilog = fields_help(self.config())
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        parser.print_help()
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dew-ray", description="Post-training for language models, in JAX on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)
    main_job = commands.add_parser("rlvr", add_help=False,
                                   help="asynchronous RLVR on a (local) Ray cluster: the built-in tasks, or your "
                                        "model, prompts and reward")
    main_job.add_argument("-h", "--help", action=FieldsHelp, config=_rlvr_config)
    main_job.add_argument("--config", help="a TOML file of RLVRPipelineConfig fields (see cluster_configs/rlvr.toml)")
    main_job.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one config field")
    main_job.add_argument("--run-dir", default=None, help="the run directory; an existing one resumes (default: runs/rlvr-<time>)")
    main_job.add_argument("--steps", type=int, default=None, help="GRPO updates")
    main_job.add_argument("--address", default=None, help="a running Ray cluster (default: RAY_ADDRESS or a local one)")
    main_job.set_defaults(run=rlvr)
    changed = commands.add_parser("fleet", help="add or remove rollout servers of a running dew-ray rlvr (applied "
                                                "before its next update)")
    changed.add_argument("run_dir", help="the run's directory (every node of the run shares it)")
    how = changed.add_mutually_exclusive_group(required=True)
    how.add_argument("--add", type=int, metavar="N", help="start N more rollout servers (at most servers_max in all)")
    how.add_argument("--remove", type=int, metavar="N", help="take the N newest live rollout servers out (at least "
                                                             "servers_min stay)")
    changed.add_argument("--drain", type=float, default=30.0, help="seconds a removed server's draws get to finish "
                                                                   "before they are drawn again on the others")
    changed.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the driver to take the request "
                                                                   "(then it is withdrawn; 0: queue it and return)")
    changed.set_defaults(run=fleet)
    replayed = commands.add_parser("replay", help="train a dew-ray rlvr run again from its record (no Ray, servers "
                                                  "or sandboxes) and check its parameters bit for bit")
    replayed.add_argument("run_dir", help="the run's directory (recorded with record=true, the default)")
    replayed.add_argument("--until", type=int, default=None, metavar="N", help="replay only the first N steps")
    replayed.set_defaults(run=replay)
    demo = commands.add_parser("sft-demo", help="train the tiny built-in decoder on the built-in story corpus")
    demo.add_argument("--steps", type=int, default=200)
    demo.add_argument("--batch", type=int, default=16)
    demo.add_argument("--seq-len", type=int, default=64)
    demo.add_argument("--learning-rate", type=float, default=3e-3)
    demo.add_argument("--log-every", type=int, default=50)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--output-dir", default=None, help="write checkpoints and metrics.jsonl here (default: nothing)")
    demo.set_defaults(run=sft_demo)
    served = commands.add_parser("serve", help="serve a decoder over an OpenAI-compatible HTTP API")
    served.add_argument("--checkpoint", help="a Hugging Face Llama/Qwen2/Qwen3 directory (default: the story decoder)")
    served.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only; any other "
                                                             "address needs --api-key or --unauthenticated)")
    served.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every /v1 route, as vLLM's --api-key (repeat "
                             "for several keys; default: VLLM_API_KEY if set)")
    served.add_argument("--unauthenticated", action="store_true",
                        help="listen beyond loopback without an API key (everyone who reaches it may use the model)")
    served.add_argument("--port", type=int, default=8000)
    served.add_argument("--slots", type=int, default=8)
    served.add_argument("--capacity", type=int, default=256)
    served.add_argument("--lanes", type=int, default=1,
                        help="groups of slots that decode side by side on their own threads (must divide --slots)")
    served.add_argument("--block-size", type=int, default=None,
                        help="positions of the KV cache's first block (default: the Server's, 64); a decode step "
                             "reads only the blocks its requests reach")
    served.add_argument("--temperature", type=float, default=1.0)
    served.add_argument("--top-k", type=int, default=None)
    served.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    served.add_argument("--train-steps", type=int, default=200, help="training steps for the built-in story decoder")
    served.set_defaults(run=serve)
    for kind, what in (("sft", "supervised fine-tuning on conversations"), ("dpo", "DPO on preference pairs"),
                       ("grpo", "GRPO on prompts with a reward")):
        command = commands.add_parser(kind, add_help=False, help=f"{what}: one stage on a Hugging Face model directory")
        command.add_argument("-h", "--help", action=FieldsHelp, config=_stage_config)
        command.add_argument("--model", help="the Hugging Face model directory (config field 'model')")
        command.add_argument("--data", help="a Parquet or JSONL file or a datasets directory (config field 'data')")
        command.add_argument("--output-dir", default=None, help="checkpoints, metrics.jsonl and policy/ "
                                                                 "(default: runs/<command>-<time>)")
        command.add_argument("--steps", type=int, default=None)
        command.add_argument("--config", help=f"a TOML file of StageRun fields (flat or under [{kind}])")
        command.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one field")
        command.set_defaults(run=stage, kind=kind)
    chained = commands.add_parser("chain", add_help=False, help="SFT -> DPO -> GRPO stages on a (local) Ray cluster")
    chained.add_argument("-h", "--help", action=FieldsHelp, config=_chain_config)
    chained.add_argument("--config", required=True, help="a TOML file of ChainConfig fields with [[stages]] tables")
    chained.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one field")
    chained.add_argument("--address", default=None, help="a running Ray cluster (default: RAY_ADDRESS or a local one)")
    chained.set_defaults(run=chain)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
