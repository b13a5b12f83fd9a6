"""``python -m hyper_parallel.auto --config demo --world 64 --devices-per-node 8 --device-memory 80GiB``

Prints the top plans for a model on a cluster. ``--config`` is one of the example's configs
(``examples/llama/configs.py``: tiny, demo, moe-tiny, moe-demo, long; run from the repository root) or
``package.module:function`` returning ``(model, global_batch, seq_len)`` or a model (then pass
``--global-batch`` and ``--seq-len``). The model is built on the meta device.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch


def _load(spec):
    if ":" in spec:
        mod, fn = spec.split(":", 1)
        with torch.device("meta"):
            out = getattr(importlib.import_module(mod), fn)()
        return out if isinstance(out, tuple) else (out, None, None)
    sys.path.insert(0, os.getcwd())
    try:
        from examples.llama.configs import get_config
        from examples.llama.model import Transformer
    except ImportError as e:
        raise SystemExit(f"--config {spec!r}: the example configs (examples/llama/configs.py) are importable only "
                         f"from the repository root; or pass package.module:function ({e})") from None
    try:
        cfg = get_config(spec)
    except KeyError as e:
        raise SystemExit(f"--config: {e.args[0]}") from None
    with torch.device("meta"):
        return Transformer(cfg.model, init_seed=None), cfg.global_batch, cfg.seq_len


def main(argv=None):
    from hyper_parallel.auto import Cluster, explain_rejections, plan
    p = argparse.ArgumentParser(prog="python -m hyper_parallel.auto", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="example config name or package.module:function")
    p.add_argument("--world", type=int, required=True, help="number of devices")
    p.add_argument("--devices-per-node", type=int, default=8)
    p.add_argument("--device-memory", default=None, help="per-device memory, e.g. 80GiB (default: the preset's)")
    p.add_argument("--preset", default="h100", help="GPU preset for speeds: h100, h200, a100, a100-40gb, b200")
    p.add_argument("--global-batch", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--param-dtype", default=None, help="e.g. bfloat16 (mixed precision compute / all-gather)")
    p.add_argument("--reduce-dtype", default=None, help="e.g. float32 (gradient reduction)")
    p.add_argument("--parallelisms", default="dp,fsdp,tp,sp,pp,cp,ep")
    p.add_argument("--ac", default="auto", help="activation checkpointing: auto, none, full")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--rejections", type=int, default=0, metavar="N", help="also print N rejected candidates")
    a = p.parse_args(argv)
    model, gb, sl = _load(a.config)
    gb, sl = a.global_batch or gb, a.seq_len or sl
    if not gb or not sl:
        raise SystemExit("--global-batch and --seq-len are needed for this --config")
    over = {} if a.device_memory is None else {"device_memory": a.device_memory}
    cluster = Cluster.preset(a.preset, a.world, a.devices_per_node, **over)
    dt = lambda name: getattr(torch, name) if name else None
    t0 = time.perf_counter()
    try:
        plans = plan(model, cluster, global_batch=gb, seq_len=sl, param_dtype=dt(a.param_dtype),
                     reduce_dtype=dt(a.reduce_dtype), parallelisms=tuple(x for x in a.parallelisms.split(",") if x),
                     activation_checkpointing=a.ac, top_k=a.top_k)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    took = time.perf_counter() - t0
    n = sum(x.numel() for x in model.parameters())
    print(f"{a.config}: {n / 1e6:,.1f} M parameters, global batch {gb} x {sl}; cluster: {cluster.describe()}")
    print(f"planned in {took:.2f}s; top {len(plans)} plans (best first):\n")
    for i, pl in enumerate(plans):
        print(f"#{i + 1} " + pl.explain())
        print("   args: " + " ".join(pl.to_args()) + "\n")
    if a.rejections:
        print(explain_rejections(a.rejections))


if __name__ == "__main__":
    main()
