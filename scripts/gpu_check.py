"""GPU smoke and parity checks for one CUDA device (NCCL, world size 1).

Run by ``scripts/gpu_check.sh`` on a machine with a GPU (CI has none: everything else is tested on
CPU/gloo). Each check compares against the same computation on plain tensors in float64 and
prints one PASS/FAIL/SKIP line; the last lines are a summary table. Exit status 1 if any check
failed. What it covers that the CPU suite cannot: the NCCL process group, DTensors on CUDA,
``.cuda()``/``.cpu()``/``.to()`` moves between devices (issue 24, class 3), ``fully_shard`` with
``CPUOffloadPolicy`` on CUDA, and ``torch.compile`` of DTensor code with inductor's GPU backend.
"""
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

RESULTS = []


def check(name):
    def deco(fn):
        t0 = time.perf_counter()
        try:
            extra = fn()
            RESULTS.append((name, "PASS", f"{time.perf_counter() - t0:.2f}s", extra or ""))
        except _Skip as s:
            RESULTS.append((name, "SKIP", "", str(s)))
        except Exception as e:  # noqa: BLE001 - a check's failure is reported, the others still run
            traceback.print_exc()
            RESULTS.append((name, "FAIL", f"{time.perf_counter() - t0:.2f}s", f"{type(e).__name__}: {e}"[:160]))
        return fn
    return deco


class _Skip(Exception):
    pass


def close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def main():
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check")
        return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    import hyper_parallel as hp
    from hyper_parallel import Replicate, Shard
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0)}, backend {dist.get_backend()}")
    mesh = hp.init_device_mesh("cuda", (1,), mesh_dim_names=("tp",))
    dev = torch.device("cuda", 0)

    @check("DTensor ops on CUDA (matmul, softmax, backward) vs plain, float64")
    def _ops():
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
        assert xd.to_local().is_cuda and xd.grad.to_local().is_cuda

    @check(".cpu() / .cuda() / .to(device, dtype) keep the layout; gradients come back (issue 24 class 3)")
    def _moves():
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

    @check("TP MLP (Colwise + Rowwise) on a CUDA mesh vs plain, float64")
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
        for (n, p), rp in zip(model.named_parameters(), ref.parameters()):
            close(p.grad.full_tensor(), rp.grad)

    @check("fully_shard with CPUOffloadPolicy on CUDA: 3 AdamW steps vs plain, float64")
    def _offload():
        torch.manual_seed(2)
        ref = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double().to(dev)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
        model.load_state_dict({k: v.cpu() for k, v in ref.state_dict().items()})
        fmesh = hp.init_device_mesh("cuda", (1,))
        for m in (model[0], model[2]):
            hp.fully_shard(m, mesh=fmesh, offload_policy=hp.CPUOffloadPolicy())
        hp.fully_shard(model, mesh=fmesh, offload_policy=hp.CPUOffloadPolicy())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step in range(3):
            x = torch.randn(8, 16, dtype=torch.float64, device=dev)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            rl = ref(x).pow(2).mean()
            rl.backward()
            ropt.step()
            ropt.zero_grad()
            close(loss.detach(), rl.detach())
        for p, rp in zip(model.parameters(), ref.parameters()):
            assert p.to_local().device.type == "cpu", "offloaded parameters live on the CPU between steps"
            close(p.full_tensor().to(dev), rp.detach())

    @check("torch.compile (inductor, CUDA) of a DTensor function, fullgraph, vs eager")
    def _compile():
        x = torch.randn(32, 64, device=dev)
        w = torch.randn(64, 64, device=dev)
        xd = hp.distribute_tensor(x, mesh, [Shard(0)])
        wd = hp.distribute_tensor(w, mesh, [Replicate()])

        def f(a, b):
            return torch.relu(a @ b).sum(-1)
        if not torch.__version__.startswith("2.13"):
            raise _Skip(f"compile support needs torch 2.13 (opaque value types); this machine has {torch.__version__}")
        cf = torch.compile(f, fullgraph=True)
        got = cf(xd, wd)
        torch.testing.assert_close(got.full_tensor(), f(x, w), rtol=1e-4, atol=1e-4)

    @check("per-op overhead on CUDA (64x64 add, 2000 calls): ours vs plain")
    def _overhead():
        a = torch.randn(64, 64, device=dev)
        ad = hp.distribute_tensor(a, mesh, [Shard(0)])
        for t in (a, ad):
            for _ in range(200):
                t + t
        torch.cuda.synchronize()
        times = {}
        for name, t in (("plain", a), ("ours", ad)):
            t0 = time.perf_counter()
            for _ in range(2000):
                t + t
            torch.cuda.synchronize()
            times[name] = (time.perf_counter() - t0) / 2000 * 1e6
        return f"plain {times['plain']:.1f} us, ours {times['ours']:.1f} us per add"

    dist.destroy_process_group()
    print("\n| check | result | time | note |\n|---|---|---|---|")
    for r in RESULTS:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} |")
    return 1 if any(r[1] == "FAIL" for r in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())
