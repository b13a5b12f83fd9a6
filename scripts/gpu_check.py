"""GPU checks: NCCL on every visible GPU, against plain tensors / one process / torch's FSDP2.

Run by ``scripts/gpu_check.sh`` (world size 1 on one GPU; torchrun over all GPUs when there are
several) with the machine's own ``python3``/torch (no install, no network); CI has no GPU. Each
check prints one row of a PASS/FAIL/SKIP table with its time; exit status 1 if any check failed.
Without CUDA every check is a SKIP and the exit status is 0.

Checks (``CHECKS``): the DTensor core on CUDA tensors over NCCL (ops + backward, uneven
redistributions, Partial reductions), device moves, a TP MLP, ``fully_shard`` with
``CPUOffloadPolicy(pin_memory=True)``, bf16 ``MixedPrecisionPolicy`` against torch's FSDP2,
``torch.compile`` (inductor, so Triton kernels) of a TP block, sequence-sharded SDPA on the flash
backend, 5 training steps of the example Llama with TP on CUDA against one process, and the per-op
cost of a DTensor add. ``GPU_CHECK_DEVICE=cpu`` runs the same script on gloo/CPU as a dry run of
the script itself (``moves`` is a SKIP there; pinning is not checked; inductor emits C++, not
Triton). ``GPU_CHECK_LOCAL_COMPILE=1`` takes the compile check's torch < 2.13 path (the local TP
computation compiled) on any torch; ``GPU_CHECK_ONLY=a,b`` runs only those checks.
"""
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

CHECKS = [
    ("dtensor-nccl", "DTensor core on CUDA over NCCL: matmul/softmax/backward, uneven S0->S1->R, Partial(sum/max) reductions, fp64"),
    ("moves", ".cpu() / .cuda() / .to(device, dtype) keep the layout; gradients come back"),
    ("tp-mlp", "TP MLP (Colwise + Rowwise) on a CUDA mesh vs plain, fp64"),
    ("fsdp-offload", "fully_shard + CPUOffloadPolicy(pin_memory=True): pinned CPU shards, 3 AdamW steps vs plain, fp64"),
    ("fsdp-bf16", "fully_shard + MixedPrecisionPolicy(bf16 params, fp32 reduce) vs torch FSDP2, 5 AdamW steps"),
    ("compile-tp", "torch.compile (inductor -> Triton) of a TP block, forward + backward vs eager"),
    ("sdpa-flash", "sequence-sharded SDPA on the flash backend (bf16), no forward collective, vs one process"),
    ("example-train", "example Llama (tiny), TP over all GPUs, 5 AdamW steps vs one process on CUDA"),
    ("overhead", "per-op cost on CUDA (64x64 add, 2000 calls): ours vs plain"),
    ("auto-measure", "hyper_parallel.auto: Cluster.measure() on the NCCL world (bf16 matmul, collectives), then plan() for the example Llama"),
]
RESULTS = {}


class _Skip(Exception):
    pass


def run_check(key, fn):
    t0 = time.perf_counter()
    try:
        note = fn()
        RESULTS[key] = ("PASS", time.perf_counter() - t0, note or "")
    except _Skip as s:
        RESULTS[key] = ("SKIP", time.perf_counter() - t0, str(s))
    except Exception as e:  # noqa: BLE001 - a check's failure is reported, the others still run
        traceback.print_exc()
        RESULTS[key] = ("FAIL", time.perf_counter() - t0, f"{type(e).__name__}: {e}".replace("\n", " ")[:200])


def close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def table(rows, total):
    print("\n| check | result | time | note |\n|---|---|---|---|")
    for key, desc in CHECKS:
        res, t, note = rows.get(key, ("SKIP", 0.0, "not run"))
        print(f"| {key}: {desc} | {res} | {t:.1f} s | {note} |")
    verdicts = {r[0] for r in rows.values()}
    overall = "FAIL" if "FAIL" in verdicts else "PASS" if "PASS" in verdicts else "SKIP"
    print(f"| total | {overall} | {total:.1f} s | |")


def main():
    t_start = time.perf_counter()
    want = os.environ.get("GPU_CHECK_DEVICE", "cuda")
    if want == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False); "
              "every check skipped")
        table({k: ("SKIP", 0.0, "no CUDA device") for k, _ in CHECKS}, time.perf_counter() - t_start)
        return 0
    if "MASTER_PORT" not in os.environ:  # one process, no torchrun: a free port, never a fixed one
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = want == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl" if cuda else "gloo")
    import hyper_parallel as hp
    from hyper_parallel import Partial, Replicate, Shard
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype_name = dev.type
    if rank == 0:
        name = torch.cuda.get_device_name(dev) if cuda else "cpu (dry run)"
        print(f"gpu_check: torch {torch.__version__}, {ws} x {name}, backend {dist.get_backend()}")
    mesh = hp.init_device_mesh(dtype_name, (ws,), mesh_dim_names=("tp",))

    def need_cuda():
        if not cuda:
            raise _Skip("CUDA only (dry run on CPU)")

    def _dtensor_nccl():
        torch.manual_seed(0)
        x = torch.randn(16, 32, dtype=torch.float64, device=dev, requires_grad=True)
        w = torch.randn(32, 8, dtype=torch.float64, device=dev, requires_grad=True)
        xd = hp.distribute_tensor(x.detach(), mesh, [Shard(0)]).requires_grad_()
        wd = hp.distribute_tensor(w.detach(), mesh, [Replicate()]).requires_grad_()
        out = torch.softmax(xd @ wd, -1).pow(2).sum()
        ref = torch.softmax(x @ w, -1).pow(2).sum()
        out.backward()
        ref.backward()
        close(out.full_tensor(), ref.detach())
        close(wd.grad.full_tensor(), w.grad)
        close(xd.grad.full_tensor(), x.grad)
        assert xd.to_local().device.type == dev.type and xd.grad.to_local().device.type == dev.type
        # uneven shapes (7 x 5 over ws pieces): all_to_all and all_gather with padding on NCCL
        u = torch.randn(7, 5, dtype=torch.float64, device=dev)
        ud = hp.distribute_tensor(u, mesh, [Shard(0)]).requires_grad_()
        v = ud.redistribute(mesh, [Shard(1)]).redistribute(mesh, [Replicate()])
        close(v.to_local(), u)
        (v.to_local() * 3).sum().backward()
        close(ud.grad.full_tensor(), torch.full_like(u, 3.0))
        # Partial(sum) and Partial(max) pieces reduced over NCCL
        piece = torch.arange(6, dtype=torch.float64, device=dev) + rank
        ps = hp.DTensor.from_local(piece, mesh, [Partial("sum")], shape=(6,), stride=(1,))
        pm = hp.DTensor.from_local(piece, mesh, [Partial("max")], shape=(6,), stride=(1,))
        base = torch.arange(6, dtype=torch.float64, device=dev)
        close(ps.full_tensor(), base * ws + sum(range(ws)))
        close(pm.full_tensor(), base + ws - 1)
        return f"world size {ws}"

    def _moves():
        need_cuda()
        x = torch.randn(8, 6, dtype=torch.float64, device=dev)
        d = hp.distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
        c = d.cpu()
        assert c.placements == d.placements and not c.to_local().is_cuda and c.device.type == "cpu"
        g = c.cuda()
        assert g.placements == d.placements and g.to_local().is_cuda
        h = d.to("cpu", torch.float32)
        assert h.dtype == torch.float32 and h.placements == d.placements
        (c.sum() + g.sum() * 2 + h.double().sum()).backward()
        close(d.grad.full_tensor(), torch.full_like(x, 4.0))
        assert d.grad.to_local().is_cuda and d.grad.dtype == torch.float64

    def _tp():
        torch.manual_seed(1)
        ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).double().to(dev)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).double().to(dev)
        model.load_state_dict(ref.state_dict())
        hp.parallelize_module(model, mesh, {"0": hp.ColwiseParallel(), "2": hp.RowwiseParallel()})
        x = torch.randn(4, 16, dtype=torch.float64, device=dev)
        out = model(x)
        out = out.full_tensor() if isinstance(out, hp.DTensor) else out
        out.pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        close(out, ref(x).detach())
        for p, rp in zip(model.parameters(), ref.parameters()):
            close(p.grad.full_tensor(), rp.grad)

    def _offload():
        torch.manual_seed(2)
        ref = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double().to(dev)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
        model.load_state_dict({k: v.cpu() for k, v in ref.state_dict().items()})
        fmesh = hp.init_device_mesh(dtype_name, (ws,))
        pol = hp.CPUOffloadPolicy(pin_memory=True)
        for m in (model[0], model[2]):
            hp.fully_shard(m, mesh=fmesh, offload_policy=pol)
        hp.fully_shard(model, mesh=fmesh, offload_policy=pol)
        for p in model.parameters():
            assert p.to_local().device.type == "cpu" and (p.to_local().is_pinned() or not cuda), "pinned CPU shards"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step in range(3):
            x = torch.randn(8 * ws, 16, dtype=torch.float64, device=dev)
            loss = model(x[rank::ws]).pow(2).mean()
            loss.backward()
            for p in model.parameters():
                assert p.grad.to_local().device.type == "cpu", "gradients land on the CPU"
            opt.step()
            opt.zero_grad()
            rl = ref(x).pow(2).mean()
            rl.backward()
            ropt.step()
            ropt.zero_grad()
        for p, rp in zip(model.parameters(), ref.parameters()):
            assert p.to_local().device.type == "cpu" and (p.to_local().is_pinned() or not cuda), "pinned after steps"
            close(p.full_tensor().to(dev), rp.detach())
        return "shards pinned on the CPU before and after the steps"

    def _bf16():
        import copy
        from torch.distributed.device_mesh import init_device_mesh as torch_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP, fully_shard as torch_fully_shard
        torch.manual_seed(3)
        ours = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32),
                                   torch.nn.GELU(), torch.nn.Linear(32, 8)).to(dev)
        theirs = copy.deepcopy(ours)
        fmesh = hp.init_device_mesh(dtype_name, (ws,))
        tmesh = torch_mesh(dtype_name, (ws,))
        kw = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for i in (0, 2, 4):
            hp.fully_shard(ours[i], mesh=fmesh, mp_policy=hp.MixedPrecisionPolicy(**kw))
            torch_fully_shard(theirs[i], mesh=tmesh, mp_policy=TorchMP(**kw))
        hp.fully_shard(ours, mesh=fmesh, mp_policy=hp.MixedPrecisionPolicy(**kw))
        torch_fully_shard(theirs, mesh=tmesh, mp_policy=TorchMP(**kw))
        o1 = torch.optim.AdamW(ours.parameters(), lr=1e-2)
        o2 = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
        worst = 0.0
        for s in range(5):
            g = torch.Generator(device=dev).manual_seed(s)
            x = torch.randn(16 * ws, 32, device=dev, generator=g)[rank::ws]
            y = torch.randn(16 * ws, 8, device=dev, generator=g)[rank::ws]
            out1, out2 = ours(x), theirs(x)
            assert out1.dtype == torch.bfloat16 and out2.dtype == torch.bfloat16, (out1.dtype, out2.dtype)
            l1, l2 = (out1.float() - y).pow(2).mean(), (out2.float() - y).pow(2).mean()
            torch.testing.assert_close(l1, l2, rtol=1e-2, atol=1e-3)
            worst = max(worst, abs(l1.item() - l2.item()))
            l1.backward()
            l2.backward()
            for p, q in zip(ours.parameters(), theirs.parameters()):
                assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
                torch.testing.assert_close(p.grad.to_local(), q.grad.to_local(), rtol=2e-2, atol=2e-3)
            o1.step(), o2.step(), o1.zero_grad(), o2.zero_grad()
        return f"largest loss difference vs torch FSDP2 {worst:.2e}"

    def _compile():
        from hyper_parallel.compile import compile_mode as support
        torch.manual_seed(4)
        ref = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(dev)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(dev)
        model.load_state_dict(ref.state_dict())
        hp.parallelize_module(model, mesh, {"0": hp.ColwiseParallel(), "2": hp.RowwiseParallel()})
        x = torch.randn(32, 64, device=dev)
        torch._dynamo.reset()
        if support._STATE.get("opaque_error") is None and not os.environ.get("GPU_CHECK_LOCAL_COMPILE"):
            mode = "whole DTensor block, fullgraph"
            cm = torch.compile(model, backend="inductor", fullgraph=True, dynamic=False)
            out = cm(x)
            out = out.full_tensor() if isinstance(out, hp.DTensor) else out
        else:
            # this torch cannot trace DTensors (the library refuses: no opaque value types before 2.13):
            # compile the block's local computation, the TP collectives stay eager around it
            mode = f"local TP computation (torch {torch.__version__} cannot trace DTensors)"
            w1, b1 = model[0].weight, model[0].bias
            w2, b2 = model[2].weight, model[2].bias

            def local_block(xl, w1l, b1l, w2l):
                return torch.nn.functional.gelu(xl @ w1l.t() + b1l) @ w2l.t()
            cf = torch.compile(local_block, backend="inductor", fullgraph=True, dynamic=False)
            part = cf(x, w1.to_local(), b1.to_local(), w2.to_local())
            pd = hp.DTensor.from_local(part, mesh, [Partial()], shape=(32, 64), stride=(64, 1))
            out = (pd + b2).full_tensor()
        r = ref(x)
        torch.testing.assert_close(out, r.detach(), rtol=1e-4, atol=1e-4)
        out.pow(2).sum().backward()
        r.pow(2).sum().backward()
        for p, rp in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), rp.grad, rtol=1e-4, atol=1e-4)
        return mode

    def _sdpa():
        from torch.nn.attention import SDPBackend, sdpa_kernel
        F = torch.nn.functional
        torch.manual_seed(5)
        b, h, s, d = 2, 4, 256, 64
        q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        qd = hp.distribute_tensor(q, mesh, [Shard(2)]).requires_grad_()
        kd = hp.distribute_tensor(k, mesh, [Replicate()]).requires_grad_()
        vd = hp.distribute_tensor(v, mesh, [Replicate()]).requires_grad_()
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), hp.CommDebugMode() as comm:
            out = F.scaled_dot_product_attention(qd, kd, vd)
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        assert tuple(out.placements) == (Shard(2),), out.placements
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            g = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16)
            (out.full_tensor().float() * g.float()).sum().backward()
        qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
        with sdpa_kernel([SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(qr, kr, vr)
        (ref * g.float()).sum().backward()
        torch.testing.assert_close(out.full_tensor().float(), ref.detach(), rtol=2e-2, atol=2e-2)
        for dt_, r_ in ((qd, qr), (kd, kr), (vd, vr)):
            torch.testing.assert_close(dt_.grad.full_tensor().float(), r_.grad, rtol=5e-2, atol=5e-2)
        return f"q {tuple(q.shape)} sharded on the sequence over {ws}, K/V whole"

    def _train():
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from examples.llama.configs import get_config
        from examples.llama.data import TokenBatches
        from examples.llama.model import build_model, loss_fn
        from examples.llama.parallelize import parallelize_llama, train_loss
        from examples.llama.reference import build_optimizer
        cfg = get_config("tiny")
        if cfg.model.n_kv_heads % ws or cfg.model.ffn_hidden_dim % ws or cfg.model.vocab_size % ws:
            raise _Skip(f"the tiny config cannot be split over tp={ws}")
        tmesh = hp.init_device_mesh(dtype_name, (1, ws), mesh_dim_names=("dp", "tp"))
        model = build_model(cfg.model, cfg.seed).to(dev)
        parallelize_llama(model, tmesh, sequence_parallel=True, loss_parallel=False, src_data_rank=None)
        ref = build_model(cfg.model, cfg.seed).to(dev)
        opt, ropt = build_optimizer(model.parameters(), cfg.optim), build_optimizer(ref.parameters(), cfg.optim)
        data = TokenBatches(seed=cfg.seed)
        worst = 0.0
        for step in range(5):
            x, y = (t.to(dev) for t in data.get_batch(step, cfg.global_batch, cfg.seq_len))
            opt.zero_grad(set_to_none=True)
            loss = train_loss(model, x, y, loss_fn, loss_parallel=False)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
            opt.step()
            ropt.zero_grad(set_to_none=True)
            rl = loss_fn(ref(x), y)
            rl.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.optim.max_grad_norm)
            ropt.step()
            lv = loss.full_tensor().item() if isinstance(loss, hp.DTensor) else float(loss)
            worst = max(worst, abs(lv - rl.item()))
        assert worst < 1e-4, f"largest loss difference {worst:.2e}"
        return f"5 steps, tp={ws}, sp on; largest loss difference {worst:.1e}"

    def _overhead():
        a = torch.randn(64, 64, device=dev)
        ad = hp.distribute_tensor(a, mesh, [Shard(0)])
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        for t in (a, ad):
            for _ in range(200):
                t + t
        sync()
        times = {}
        for name, t in (("plain", a), ("ours", ad)):
            t0 = time.perf_counter()
            for _ in range(2000):
                t + t
            sync()
            times[name] = (time.perf_counter() - t0) / 2000 * 1e6
        return f"plain {times['plain']:.1f} us, ours {times['ours']:.1f} us per add"

    def _auto():
        from hyper_parallel.auto import Cluster, plan
        from examples.llama.model import ModelArgs, Transformer
        name = torch.cuda.get_device_name().lower() if cuda else ""
        preset = "h200" if "h200" in name else ("h100" if "h100" in name else None)
        base = Cluster.preset(preset, world_size=ws) if preset else Cluster(ws, ws, "16GiB")
        measured = base.measure()
        assert measured.flops > 0 and measured.flops < float("inf"), measured.flops
        with torch.device("meta"):
            model = Transformer(ModelArgs(dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, vocab_size=32000,
                                          multiple_of=256, max_seq_len=2048))
        plans = plan(model, measured, global_batch=8 * ws, seq_len=2048, param_dtype=torch.bfloat16,
                     reduce_dtype=torch.float32, top_k=1)
        ratio = f", {measured.flops / base.flops:.2f}x the {preset} preset" if preset else ""
        return (f"matmul {measured.flops / 1e12:.0f} TFLOP/s{ratio}; top plan {plans[0].mesh_shape} "
                f"{plans[0].step_time.total * 1e3:.1f} ms predicted")

    fns = {"dtensor-nccl": _dtensor_nccl, "moves": _moves, "tp-mlp": _tp, "fsdp-offload": _offload,
           "fsdp-bf16": _bf16, "compile-tp": _compile, "sdpa-flash": _sdpa, "example-train": _train,
           "overhead": _overhead, "auto-measure": _auto}
    only = os.environ.get("GPU_CHECK_ONLY")
    for key, _ in CHECKS:
        if only and key not in only.split(","):
            continue
        run_check(key, fns[key])
        if rank == 0:
            res, t, note = RESULTS[key]
            print(f"gpu_check: {res} {key} ({t:.1f} s) {note}", flush=True)
    # every rank's verdicts: a check that failed on any rank fails
    verdicts = [None] * ws
    dist.all_gather_object(verdicts, {k: r[0] for k, r in RESULTS.items()})
    for k in RESULTS:
        if any(v.get(k) == "FAIL" for v in verdicts) and RESULTS[k][0] != "FAIL":
            RESULTS[k] = ("FAIL", RESULTS[k][1], "failed on another rank")
    dist.destroy_process_group()
    if rank == 0:
        table(RESULTS, time.perf_counter() - t_start)
    return 1 if any(r[0] == "FAIL" for r in RESULTS.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
