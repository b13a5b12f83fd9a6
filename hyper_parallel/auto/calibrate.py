"""``Cluster.measure()``'s microbenchmarks: what this library's execution costs on the launched world.

Why measured here and not taken from a data sheet: on a CPU world (gloo, several ranks sharing cores) a
training step of a small model is mostly host work, not FLOPs, so the cost model needs the price of
each unit of work the library actually issues, timed the way a step runs it:

* every timing starts after a barrier, so all ranks run the benchmark at once and share the cores as in
  a step (4 ranks on 2 cores: each gets about half); host work is the minimum of ``repeats`` blocks of
  at least 40 ms, each timed until every rank has finished it (a rank that ran first and alone would
  see a whole core; a step, synchronised by its collectives, runs at the shared cores' throughput)
  (other jobs on the machine only add time), a difference (checkpointed vs plain, DTensor vs plain, FSDP
  vs plain) is timed in alternating blocks; collectives are the median (waiting for peers is their
  cost) of rounds over all kinds and sizes; every figure is the slowest rank's (all ranks agree);
* ``flops``: a square matmul; ``op``: host seconds per aten op of a small MLP's forward + backward;
  ``ac_op``: the extra seconds per forward op of the same MLP under activation checkpointing (recompute
  and the checkpoint's hooks);
* ``dtensor_op``: the extra seconds of one op dispatched on a DTensor through a ``ColwiseParallel``
  Linear (input/output hooks included) over a plain Linear's forward;
* ``optim``: seconds per parameter tensor of one AdamW step, plain tensors and DTensors;
* collectives through the library's own entry points (``hyper_parallel.distributed.collectives``: what
  TP/SP and the replicated gradient all_reduce call) on real groups of every measured size, at a small
  and a large message: ``(kind, n) -> (seconds per call, bytes/s on the wire)``;
* ``fsdp_unit``: seconds per ``fully_shard`` unit per forward + backward over a group of ``n`` (the
  hooks, the copy-in/out and the all_gather / all_gather / reduce_scatter of a small unit), from a chain
  of ``fully_shard``-ed Linears minus the same chain without FSDP.

Equations: docs/auto_parallel.md "Calibration".
"""
from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
MIN_BLOCK = 0.04  # seconds per timed block of host work


def group_sizes(world: int, cap: int = 8):
    """Group sizes to calibrate: the powers of two dividing ``world`` up to ``cap``, and ``world`` itself
    when small (a 1024-rank world measures 2, 4, 8)."""
    out = [n for n in (2, 4, 8, 16, 32, 64) if n <= min(world, cap) and world % n == 0]
    if world <= cap and world not in out and world > 1:
        out.append(world)
    return sorted(out)


def wire_bytes(kind: str, nbytes: float, group_size: int) -> float:
    """Bytes one rank puts on the wire for a ``kind`` collective of a full buffer of ``nbytes`` over
    ``group_size`` ranks."""
    if kind == "all_reduce":
        return 2 * (group_size - 1) / group_size * nbytes
    if kind == "p2p":
        return nbytes
    return (group_size - 1) / group_size * nbytes


def fit_call(points):
    """(wire bytes, seconds) at a small and a large message -> (seconds per call >= 0, bytes/s)."""
    (x0, t0), (x1, t1) = points[0], points[-1]
    if t1 <= t0 or x1 <= x0:  # noise swamped the size difference: the large message's time is all bandwidth
        return t0, x1 / max(t1, 1e-12)
    b = (t1 - t0) / (x1 - x0)
    return max(t0 - b * x0, 0.0), 1.0 / b


class _Timer:
    """Barrier-started, median-of-blocks timing on every rank of ``group`` at once."""

    def __init__(self, group, repeats, sync):
        self.group, self.repeats, self.sync = group, repeats, sync
        self.n = dist.get_world_size(group)

    def _block(self, func, iters, until_all=False):
        if self.n > 1:
            dist.barrier(group=self.group)
        t0 = time.perf_counter()
        for _ in range(iters):
            func()
        self.sync()
        if until_all and self.n > 1:  # until every rank is done: the shared cores' throughput, as a step sees it
            dist.barrier(group=self.group)
        return (time.perf_counter() - t0) / iters

    def __call__(self, func, iters=1):
        """Median seconds per call (collectives: waiting for peers is part of their cost)."""
        func()
        self.sync()
        return statistics.median(self._block(func, iters) for _ in range(self.repeats))

    def interleaved(self, fns, iters=1):
        """Median seconds per call of each of ``fns``, timed in rounds over all of them (a load spike on
        the machine hits every function alike instead of the one being timed)."""
        for fn in fns:
            fn()
        self.sync()
        ts = [[] for _ in fns]
        for _ in range(self.repeats):
            for t, fn in zip(ts, fns):
                t.append(self._block(fn, iters))
        return [statistics.median(t) for t in ts]

    def pair(self, first_func, second_func, iters=1):
        """(min seconds per call of ``first_func``, of ``second_func``), timed in alternating blocks: host work,
        where other jobs on the machine only add time and a slow drift must hit both alike."""
        t0 = time.perf_counter()
        first_func(), second_func()
        self.sync()
        # blocks of at least MIN_BLOCK seconds, so that the closing barrier's latency is small beside them
        iters = max(iters, math.ceil(MIN_BLOCK / max((time.perf_counter() - t0) / 2, 1e-6)))
        if self.n > 1:  # one count on every rank (the closing barrier waits for the slowest)
            v = torch.tensor([iters], dtype=torch.int64)
            dist.all_reduce(v, op=dist.ReduceOp.MAX, group=self.group)
            iters = int(v.item())
        ta, tb = [], []
        for _ in range(self.repeats):
            ta.append(self._block(first_func, iters, until_all=True))
            tb.append(self._block(second_func, iters, until_all=True))
        return min(ta), min(tb)


def _op_overhead(timed):
    """(Seconds per aten op of a tiny MLP's forward + backward (module calls and autograd included), extra
    seconds per forward op when the MLP runs under activation checkpointing: its hooks and the recompute)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    net = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(16, 16), torch.nn.SiLU())])
    x = torch.randn(4, 16)

    def step():
        net(x).sum().backward()

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.n += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        step()
    n_all = max(_Count.n, 1)
    _Count.n = 0
    with _Count():
        net(x)
    n_fwd = max(_Count.n, 1)
    def ckpt_step():  # the same under activation checkpointing (non-reentrant, as Plan.apply wraps blocks)
        torch.utils.checkpoint.checkpoint(net, x, use_reentrant=False).sum().backward()
    t, t_ac = timed.pair(step, ckpt_step, iters=4)
    return t / n_all, max(t_ac - t, 0.0) / n_fwd


def _dtensor_costs(timed, mesh):
    """(extra seconds per DTensor-dispatched op, AdamW seconds per plain parameter, per DTensor parameter)."""
    import hyper_parallel as hp
    from hyper_parallel import ColwiseParallel, Shard, parallelize_module

    k = 8
    plain = torch.nn.Sequential(*[torch.nn.Linear(16, 16, bias=False) for _ in range(k)])
    tp = torch.nn.Sequential(*[torch.nn.Linear(16, 16 * mesh.size(), bias=False) for _ in range(k)])
    parallelize_module(tp, mesh, {str(i): ColwiseParallel() for i in range(k)}, src_data_rank=None)
    x = torch.randn(4, 16)
    # forward only (recording autograd, as in training): backward of a DTensor op is plain local autograd
    t_plain, t_dt = timed.pair(lambda: [m(x) for m in plain], lambda: [m(x) for m in tp], iters=4)
    per_op = max(t_dt - t_plain, 0.0) / k
    ps = [torch.nn.Parameter(torch.randn(16, 16)) for _ in range(k)]
    ds = [torch.nn.Parameter(hp.distribute_tensor(torch.randn(16 * mesh.size(), 16), mesh, [Shard(0)]))
          for _ in range(k)]
    opts = []
    for params in (ps, ds):
        for p in params:
            p.grad = torch.ones_like(p)
        opts.append(torch.optim.AdamW(params, lr=1e-4))
    t_p, t_d = timed.pair(opts[0].step, opts[1].step, iters=2)
    return per_op, t_p / k, t_d / k


def _fsdp_unit(timed, mesh):
    """Seconds per fully_shard unit per forward + backward over ``mesh`` (hooks + its small collectives)."""
    import hyper_parallel as hp

    k = 4
    torch.manual_seed(0)
    plain = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(k)])
    torch.manual_seed(0)
    sharded = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(k)])
    for m in sharded:
        hp.fully_shard(m, mesh=mesh)
    hp.fully_shard(sharded, mesh=mesh)
    x = torch.randn(4, 16)
    t_plain, t_fsdp = timed.pair(lambda: plain(x).sum().backward(), lambda: sharded(x).sum().backward(), iters=2)
    return max(t_fsdp - t_plain, 0.0) / k


def _collective_fn(kind, numel, group, dev):
    """A call of the library's collective of ``kind`` with a full buffer of ``numel`` float32 over ``group``."""
    from hyper_parallel.distributed import collectives as C
    n = group.size
    x = torch.ones(numel, device=dev)
    if kind == "all_reduce":
        return lambda: C.all_reduce(x, group)
    if kind == "all_gather":
        shard = x[: numel // n].contiguous()
        return lambda: C.all_gather(shard, 0, group)
    if kind == "reduce_scatter":
        return lambda: C.reduce_scatter(x, 0, group)
    if kind == "all_to_all":
        x2 = x.view(n, numel // n)  # this rank's send buffer: the full split dim, its piece of the cat dim
        return lambda: C.all_to_all(x2, 0, 1, group, [1] * n, [numel // n] * n)
    ranks = list(group.ranks)  # p2p ring, batched isend/irecv
    me = ranks.index(dist.get_rank())
    out = torch.empty_like(x)
    nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]

    def fn():
        ops = [dist.P2POp(dist.isend, x, nxt, group.handle), dist.P2POp(dist.irecv, out, prv, group.handle)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return fn


def measure_world(group, *, sizes, matmul_n, repeats, with_host):
    """Every rank of ``group``: the calibration figures (see the module docstring), slowest rank's values."""
    import hyper_parallel as hp

    n = dist.get_world_size(group)
    backend = dist.get_backend(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    timed = _Timer(group, repeats, sync)
    mn = matmul_n or (4096 if dev.type == "cuda" else 256)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(mn, mn, device=dev, dtype=dt)
    b = torch.randn(mn, mn, device=dev, dtype=dt)
    mm = lambda: torch.mm(a, b)
    times = {"matmul": timed.pair(mm, mm, iters=2)[0]}
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    meshes, groups = {}, {}
    if n > 1 and n == dist.get_world_size():  # the whole world: sub-meshes of every calibrated size
        for g in group_sizes(n):
            meshes[g] = hp.init_device_mesh(dev.type, (n // g, g), mesh_dim_names=("outer", "inner"),
                                            rank_list=ranks)["inner"]
            groups[g] = meshes[g].get_comm_group(0)
    elif n > 1:  # a subgroup: collectives at its size only (new groups would need every rank of the world)
        from hyper_parallel.distributed.comm_group import CommGroup
        groups[n] = CommGroup(ranks, group, dist.get_rank())
    if with_host:
        times["op"], times["ac_op"] = _op_overhead(timed)
        if meshes:
            m = meshes[max(meshes)]
            times["dtensor_op"], times["optim_plain"], times["optim_dtensor"] = _dtensor_costs(timed, m)
            for g, m in meshes.items():
                times[("fsdp_unit", g)] = _fsdp_unit(timed, m)
    for g, cg in groups.items():
        keys = [(kind, g, max(s // 4 // g * g, g) * 4) for kind in KINDS for s in sizes]
        fns = [_collective_fn(kind, nb // 4, cg, dev) for kind, _, nb in keys]
        # back to back, as a step issues them (the barrier's release skew is spread over the calls)
        times.update(zip(keys, timed.interleaved(fns, iters=3)))
    keys = sorted(times, key=str)
    vec = torch.tensor([times[k] for k in keys], dtype=torch.float64)
    if n > 1:
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    times = dict(zip(keys, vec.tolist()))
    out = dict(flops=2 * mn**3 / max(times["matmul"], 1e-12), comm={}, fsdp_unit={},
               op_overhead=times.get("op", 0.0), ac_op=times.get("ac_op", 0.0),
               dtensor_op=times.get("dtensor_op", 0.0),
               optim=(times.get("optim_plain", 0.0), times.get("optim_dtensor", 0.0)))
    for g in groups:
        if ("fsdp_unit", g) in times:
            out["fsdp_unit"][g] = times[("fsdp_unit", g)]
        for kind in KINDS:
            pts = sorted((wire_bytes(kind, k[2], g), v) for k, v in times.items()
                         if len(k) == 3 and k[0] == kind and k[1] == g)
            if len(pts) >= 2:
                out["comm"][(kind, g)] = fit_call(pts)
    return out
