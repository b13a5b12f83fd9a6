"""One torchtitan training run on CPU, on torch's DTensor stack or on hyper_parallel's (the import swap).

    torchrun --nproc_per_node N scripts/torchtitan/run_titan.py --stack {torch,hp} --record OUT.json \
        [--save-weights W.pt | --load-weights W.pt] -- <torchtitan.train arguments>

* The CPU patches (the only changes to torchtitan's behaviour, applied to both stacks alike) are in
  :func:`cpu_patches`: device "cpu", ``torch.distributed.set_timeout`` as a no-op where torch lacks
  it, a stub for triton-only kernel modules, and SUM instead of PREMUL_SUM on gloo.
* ``--stack hp`` runs ``hyper_parallel.swap.install(["torchtitan", "spmd_types"])`` first: torchtitan's own code,
  with its ``torch.distributed.tensor*`` / ``fsdp`` / ``pipelining`` imports bound to hyper_parallel.
* Same initial weights: at the start of ``Trainer.train`` the torch run writes every parameter's full
  value (``--save-weights``) and the hp run loads them into its own layout (``--load-weights``),
  checking that the loaded parameters' full values equal the file.
* Records per step the loss, grad norm and wall time of ``train_step`` to ``--record`` (rank 0).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types


TRITON_ONLY = ("torchtitan.distributed.minimal_async_ep.kernels",)


def _triton_only(modname):
    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        def kernel(*a, **k):
            raise RuntimeError(f"{modname}.{attr} needs triton (a CUDA kernel); not available on CPU")
        return kernel
    return __getattr__


def cpu_patches():
    import torch
    import torch._utils
    import torch.distributed as dist
    torch._utils._get_available_device_type = lambda: "cpu"          # device "cpu"
    cpu = torch.cpu                                                  # (torchtitan's memory monitor)
    for name, fn in (("get_device_name", lambda *a: "cpu"), ("current_device", lambda: 0),
                     ("get_device_properties", lambda *a: types.SimpleNamespace(total_memory=1 << 40)),
                     ("reset_peak_memory_stats", lambda *a: None), ("empty_cache", lambda: None),
                     ("memory_stats", lambda *a: {})):
        if not hasattr(cpu, name):
            setattr(cpu, name, fn)
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: None          # torch.distributed.set_timeout
    # torchtitan's triton-only kernel modules (optional overrides, imported at module level): stubs
    for name in TRITON_ONLY:
        if name not in sys.modules:
            stub = types.ModuleType(name)
            stub.__getattr__ = _triton_only(name)
            sys.modules[name] = stub
    # gloo has no PREMUL_SUM: torch's FSDP2 reduce-scatters with SUM and divides afterwards
    # (its own force-sum path), on both stacks
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc
        orig = fc._get_gradient_divide_factors

        def _divide_factors(rs_group, ar_group, reduce_dtype, device_type="", factor=None, force_sum=False):
            return orig(rs_group, ar_group, reduce_dtype, device_type, factor, True)
        fc._get_gradient_divide_factors = _divide_factors
    except (ImportError, AttributeError):
        pass


def titan_cpu_patches():
    """After the swap is installed: torchtitan's timeout change after step 1 (a barrier with device ids
    and ``torch.distributed.set_timeout``, CUDA-only) is skipped."""
    from torchtitan.distributed import utils as dist_utils
    dist_utils.set_pg_timeouts = lambda *a, **k: None


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _named_params(trainer):
    for i, m in enumerate(trainer.model_parts):
        for n, p in m.named_parameters():  # names without the AC / compile wrappers' prefixes
            n = n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
            yield f"{i}.{n}", p


def save_weights(trainer, path):
    import torch
    import torch.distributed as dist
    state = {n: _full(p.detach()).clone() for n, p in _named_params(trainer)}
    if dist.get_rank() == 0:
        torch.save(state, path)
    dist.barrier()


def load_weights(trainer, path):
    import torch
    state = torch.load(path)
    names = []
    for n, p in _named_params(trainer):
        if n not in state:
            raise KeyError(f"load_weights: parameter {n} is not in {path}")
        full = state[n].to(p.dtype)
        with torch.no_grad():
            if hasattr(p, "_layout"):  # hyper_parallel's DTensor: its own layout, FSDP x TP included
                from hyper_parallel.core.dtensor.layout import _get_slice_tensor_by_layout
                p._local_tensor.copy_(_get_slice_tensor_by_layout(full, p._layout))
            elif hasattr(p, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor
                p._local_tensor.copy_(distribute_tensor(full, p.device_mesh, p.placements)._local_tensor)
            else:
                p.copy_(full)
        names.append(n)
    for n, p in _named_params(trainer):  # the loaded values are the file's
        got = _full(p.detach())
        if not torch.equal(got, state[n].to(got.dtype)):
            raise RuntimeError(f"load_weights: parameter {n} differs from {path} after loading")
    return names


def _dump_grads_at_first_clip(trainer, path):
    """Wrap torchtitan's ``clip_grad_norm_``: at its first call write every parameter's full gradient."""
    import torch
    import torch.distributed as dist
    from torchtitan.distributed import utils as dist_utils
    orig = dist_utils.clip_grad_norm_

    def clip(*a, **k):
        if dist_utils.clip_grad_norm_ is clip:
            dist_utils.clip_grad_norm_ = orig
            grads = {n: _full(p.grad.detach()).clone() for n, p in _named_params(trainer) if p.grad is not None}
            if dist.get_rank() == 0:
                torch.save(grads, path)
        return orig(*a, **k)
    dist_utils.clip_grad_norm_ = clip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stack", choices=["torch", "hp"], required=True)
    ap.add_argument("--record", required=True)
    ap.add_argument("--save-weights")
    ap.add_argument("--load-weights")
    ap.add_argument("--profile", help="cProfile of train_step from step 2 on (rank 0), written as pstats here")
    ap.add_argument("--die-at-step", type=int, help="fault injection (--fault_tolerance.enable): every rank "
                    "SIGKILLs itself inside the backward of this step (the fault-tolerance row kills a group so)")
    ap.add_argument("--start-gate", help="(--fault_tolerance.enable) a spare: after the imports, wait until this file "
                    "exists before starting torchtitan (the fault-tolerance row's restarted group)")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds of sleep after each train_step (pacing "
                    "for the fault-tolerance row, so a restarted group rejoins before the others finish)")
    ap.add_argument("--dump-grads", help="write every parameter's full gradient of step 1 (before clipping)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    titan_args = argv[cut + 1:]
    cpu_patches()
    if args.stack == "hp":
        from hyper_parallel import swap
        swap.install(["torchtitan", "spmd_types"])
    titan_cpu_patches()
    from torchtitan import trainer as titan_trainer
    from torchtitan.components import metrics as titan_metrics
    record = {"stack": args.stack, "steps": []}
    T = titan_trainer.Trainer
    orig_train, orig_step, orig_log = T.train, T.train_step, titan_metrics.MetricsProcessor.log

    def train(self, inner=orig_train):
        if args.dump_grads:
            _dump_grads_at_first_clip(self, args.dump_grads)
        if args.save_weights:
            save_weights(self, args.save_weights)
        if args.load_weights:
            record["loaded"] = len(load_weights(self, args.load_weights))
        return inner(self)

    prof = None
    if args.profile and int(os.environ.get("RANK", "0")) == 0:
        import cProfile
        prof = cProfile.Profile()

    def train_step(self, *a, inner=orig_step, **k):
        t0 = time.perf_counter()
        on = prof is not None and len(record["steps"]) >= 1
        if on:
            prof.enable()
        out = inner(self, *a, **k)
        if on:
            prof.disable()
            prof.dump_stats(args.profile)
        record["steps"][-1]["time_s"] = time.perf_counter() - t0
        time.sleep(args.step_sleep)
        return out

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, *a, **k):
        record["steps"].append({"step": step, "loss": float(global_avg_loss), "grad_norm": float(grad_norm)})
        return orig_log(self, step, global_avg_loss, global_max_loss, grad_norm, *a, **k)

    T.train, T.train_step, titan_metrics.MetricsProcessor.log = train, train_step, log
    if "--fault_tolerance.enable" in titan_args:  # torchtitan's fault-tolerant trainer overrides both
        from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer as FT
        import titan_ft
        titan_ft.patch_trainer(FT)
        ft_train, ft_step = FT.train, FT.train_step

        def ft_train_step(self, *a, **k):
            if self.step == args.die_at_step:
                titan_ft.kill_in_backward(self, lambda: _write_record(args.record, record))
            out = train_step(self, *a, inner=ft_step, **k)
            record["steps"][-1].update(titan_ft.step_state(self))
            return out
        def ft_train_(self):
            record.update(titan_ft.stack_of(self))
            return train(self, inner=ft_train)
        FT.train = ft_train_
        FT.train_step = ft_train_step
        record["every_rank"] = True
        if args.start_gate:
            titan_ft.wait_for(args.start_gate)
    if args.stack == "hp":
        record["unsupported_names"] = []
    sys.argv = ["torchtitan.train"] + titan_args
    from torchtitan.train import main as titan_main
    titan_main()
    if args.stack == "hp":
        from hyper_parallel import swap
        record["unsupported_names"] = swap.unsupported_names()
    _write_record(args.record, record)


def _write_record(path, record):
    """Rank 0 writes ``path``; with ``record["every_rank"]`` (the fault-tolerance row) rank r > 0 writes
    ``path.rankR`` too (its own state digests)."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 or record.get("every_rank"):
        with open(path if rank == 0 else f"{path}.rank{rank}", "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
