"""Train a Hugging Face causal LM under a hyper_parallel plan on CPU processes, and compare with one process.

    torchrun --nproc_per_node 4 examples/hf/train.py --config llama-tiny --dp-shard 4
    torchrun --nproc_per_node 4 examples/hf/train.py --config qwen3-tiny --dp-shard 2 --tp 2 --sp
    torchrun --nproc_per_node 4 examples/hf/train.py --config llama-tiny --dp-shard 2 --cp 2 --cp-method ulysses
    torchrun --nproc_per_node 4 examples/hf/train.py --config qwen3-tiny --dp-shard 2 --pp 2
    torchrun --nproc_per_node 4 examples/hf/train.py --config qwen3-moe-tiny --dp-shard 4 --ep 2
    torchrun --nproc_per_node 4 examples/hf/train.py --config path/to/dir --plan auto   # the planner picks

``--config`` is a built-in tiny preset (``llama-tiny``, ``qwen3-tiny``, ``qwen3-moe-tiny``), a local directory
holding a ``config.json`` (random weights from ``--seed``) or a saved checkpoint (its weights), or a path to a
``config.json``: any ``AutoModelForCausalLM``. Nothing is downloaded. The layout flags are those of
``examples/llama/train.py`` (``--ep`` borrows ranks from ``--dp-shard``); ``--plan auto`` lets
``hyper_parallel.auto`` choose them for the launched world. Every rank builds the same model, ``Plan.apply``
lays it out, and AdamW trains it on each rank's share of the global batches (``Plan.shard_batch``). Rank 0
prints the loss and gradient norm per step, then trains the same model in one process and prints the
largest relative differences; it exits with status 1 when they exceed ``--tolerance``.
See docs/huggingface.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # make `examples.hf` importable when run as a script
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train a Hugging Face causal LM with hyper_parallel on CPU")
    p.add_argument("--config", default="llama-tiny", help="preset (llama-tiny, qwen3-tiny, qwen3-moe-tiny), or a "
                   "local config / checkpoint directory, or a config.json path")
    p.add_argument("--plan", default="manual", choices=("manual", "auto"),
                   help="auto: hyper_parallel.auto plans the layout for the launched world (ignores the layout flags)")
    p.add_argument("--dp", type=int, default=1, help="replicated data-parallel degree")
    p.add_argument("--dp-shard", type=int, default=1, help="fully sharded data-parallel degree (FSDP)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree")
    p.add_argument("--cp-method", default="ring", choices=("ring", "ulysses"), help="context-parallel attention")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--pp-schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved1f1b"))
    p.add_argument("--pp-microbatches", type=int, default=None, help="microbatches (default: --pp)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (MoE; ranks borrowed from --dp-shard)")
    p.add_argument("--steps", type=int, default=5, help="AdamW steps")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step (all ranks together)")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0, help="weights (without a checkpoint) and data seed")
    p.add_argument("--dtype", default="float64", choices=tuple(DTYPES), help="parameter dtype")
    p.add_argument("--device-memory", default="4GiB", help="with --plan auto: per-rank memory for the planner")
    p.add_argument("--no-compare", action="store_true", help="skip the single-process comparison")
    p.add_argument("--tolerance", type=float, default=1e-5,
                   help="largest relative loss / gradient-norm difference accepted against one process")
    return p.parse_args(argv)


def degrees_of(args) -> dict:
    return {"dp": args.dp, "fsdp": args.dp_shard, "tp": args.tp, "pp": args.pp, "cp": args.cp, "ep": args.ep}


def check_layout(args, world: int) -> None:
    for flag in ("dp", "dp_shard", "tp", "cp", "pp", "ep"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    need = args.dp * args.dp_shard * args.tp * args.pp * args.cp
    if need != world:
        raise SystemExit(f"--dp {args.dp} x --dp-shard {args.dp_shard} x --tp {args.tp} x --pp {args.pp} x --cp "
                         f"{args.cp} = {need} must equal the number of processes ({world}); launch with torchrun "
                         f"--nproc_per_node {need}")
    if args.ep > 1 and args.dp_shard % args.ep:
        raise SystemExit(f"--ep {args.ep} borrows ranks from --dp-shard {args.dp_shard}, which it must divide")
    if args.global_batch % (args.dp * args.dp_shard):
        raise SystemExit(f"--global-batch {args.global_batch} must divide over --dp x --dp-shard = "
                         f"{args.dp * args.dp_shard} ranks")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and "MASTER_ADDR" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")
    import hyper_parallel as hp
    from examples.hf.presets import build_config
    from examples.hf.training import choose_plan, make_plan, train_parallel, train_reference
    build_config(args.config)  # a bad --config fails here, on every rank, before any collective
    dtype = DTYPES[args.dtype]
    if args.plan == "manual":
        check_layout(args, world)
    hp.init_process_group("cpu")
    rank = dist.get_rank()
    if args.plan == "auto":
        plan = choose_plan(args.config, world, global_batch=args.global_batch, seq_len=args.seq_len,
                           device_memory=args.device_memory)
    else:
        plan = make_plan(args.config, world, {k: v for k, v in degrees_of(args).items() if v > 1},
                         global_batch=args.global_batch, seq_len=args.seq_len, sequence_parallel=args.sp,
                         cp_method=args.cp_method if args.cp > 1 else None,
                         pp_schedule=args.pp_schedule if args.pp > 1 else None,
                         microbatches=args.pp_microbatches if args.pp > 1 else None)
    if rank == 0:
        print(f"hyper_parallel + transformers: {args.config}, {world} processes, {args.steps} steps, global batch "
              f"{args.global_batch}x{args.seq_len}, {args.dtype}")
        print(plan.explain(), flush=True)
    t0 = time.perf_counter()
    out = train_parallel(args.config, plan, steps=args.steps, lr=args.lr, seed=args.seed, dtype=dtype)
    elapsed = time.perf_counter() - t0
    status = 0
    if rank == 0:
        for i, (loss, norm) in enumerate(out):
            print(f"step {i + 1}: loss {loss:.6f}  grad norm {norm:.6f}")
        print(f"trained {len(out)} steps in {elapsed:.1f}s")
        if not args.no_compare:
            ref = train_reference(args.config, steps=args.steps, global_batch=args.global_batch, seq_len=args.seq_len,
                                  lr=args.lr, seed=args.seed, dtype=dtype)
            d_loss = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(out, ref))
            d_norm = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(out, ref))
            print(f"largest relative difference vs one process: loss {d_loss:.2e}, grad norm {d_norm:.2e}")
            if max(d_loss, d_norm) > args.tolerance:
                print(f"FAILED: above --tolerance {args.tolerance:g}")
                status = 1
    flag = torch.tensor([status])
    dist.all_reduce(flag)
    dist.barrier()
    dist.destroy_process_group()
    if flag.item():
        raise SystemExit(1)


if __name__ == "__main__":
    main()
