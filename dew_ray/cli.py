"""The ``dew-ray`` command.

``dew-ray sft-demo`` trains the tiny built-in decoder on dew's built-in story corpus
and prints the validation loss before and after. It runs in this process; the Ray
pipelines (async RLVR and the SFT -> DPO -> GRPO chain) are not part of dew-ray yet.
"""

from __future__ import annotations

import argparse
import sys
import time


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dew-ray", description="Post-training for language models, in JAX on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("sft-demo", help="train the tiny built-in decoder on the built-in story corpus")
    demo.add_argument("--steps", type=int, default=200)
    demo.add_argument("--batch", type=int, default=16)
    demo.add_argument("--seq-len", type=int, default=64)
    demo.add_argument("--learning-rate", type=float, default=3e-3)
    demo.add_argument("--log-every", type=int, default=50)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--output-dir", default=None, help="write checkpoints and metrics.jsonl here (default: nothing)")
    demo.set_defaults(run=sft_demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
