"""``Cluster``: what the planner knows about the machines (sizes, memory, speeds) and ``measure()``.

Speeds are alpha-beta: a collective over a group moves ``bytes_on_wire`` at ``bandwidth`` (intra- or
inter-node, bytes/s per rank) after ``latency`` seconds per message step. ``flops`` is the sustained
matmul throughput of one device (FLOP/s). Presets (``Cluster.preset``) are vendor peak figures
scaled by documented efficiencies (docs/auto_parallel.md "Calibration").
"""
from __future__ import annotations

import dataclasses
import re
import time
from typing import Dict, Optional

import torch
import torch.distributed as dist

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value, name="device_memory") -> int:
    """``80 * 2**30``, ``"80GiB"``, ``"80 GB"``, ``"512MiB"`` -> bytes (int)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be bytes (int) or a string like '80GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"{name} must be > 0 bytes, got {value!r}")
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            out = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
            if out > 0:
                return out
        raise ValueError(f"{name}={value!r} is not a memory size; expected bytes or a string like '80GiB', "
                         f"'80GB', '512MiB' (units: {', '.join(u for u in _UNITS if u)})")
    raise TypeError(f"{name} must be bytes (int) or a string like '80GiB', got {type(value).__name__}")


# name: (memory bytes, dense bf16 FLOP/s peak, intra-node bytes/s, inter-node bytes/s, latency s)
# Peak figures from the vendors' data sheets; the planner uses MFU_DEFAULT of the FLOP/s peak and
# BW_EFFICIENCY of the link bandwidths (docs/auto_parallel.md).
PRESETS: Dict[str, tuple] = {
    "h100": (80 * 2**30, 989e12, 450e9, 50e9, 10e-6),    # H100 SXM, NVLink4 900 GB/s bidir, 400 Gb/s IB per GPU
    "h200": (141 * 10**9, 989e12, 450e9, 50e9, 10e-6),   # H200 SXM: H100 compute, 141 GB HBM3e
    "a100": (80 * 2**30, 312e12, 300e9, 25e9, 10e-6),    # A100 SXM 80GB, NVLink3 600 GB/s bidir, 200 Gb/s IB
    "a100-40gb": (40 * 2**30, 312e12, 300e9, 25e9, 10e-6),
    "b200": (180 * 10**9, 2250e12, 900e9, 50e9, 10e-6),  # B200: NVLink5 1.8 TB/s bidir
}
MFU_DEFAULT = 0.45
BW_EFFICIENCY = 0.8


@dataclasses.dataclass
class Cluster:
    """``world_size`` devices, ``devices_per_node`` per node, ``device_memory`` each (bytes or "80GiB").

    ``flops`` (sustained FLOP/s per device), ``intra_node_bw`` / ``inter_node_bw`` (bytes/s per rank
    on the wire) and ``latency`` (s per message step) default to the H100 preset's effective values.
    ``comm`` (filled by :meth:`measure`) holds per-collective (latency, bandwidth) fits.
    """

    world_size: int
    devices_per_node: int
    device_memory: int
    flops: Optional[float] = None
    intra_node_bw: Optional[float] = None
    inter_node_bw: Optional[float] = None
    latency: Optional[float] = None
    comm: Dict[str, tuple] = dataclasses.field(default_factory=dict)
    op_overhead: float = 0.0

    def __init__(self, world_size, devices_per_node, device_memory, *, flops=None, intra_node_bw=None,
                 inter_node_bw=None, latency=None, comm=None, op_overhead=0.0):
        for name, v in (("world_size", world_size), ("devices_per_node", devices_per_node)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Cluster: {name} must be a positive int, got {v!r}")
        self.world_size, self.devices_per_node = world_size, devices_per_node
        self.device_memory = parse_bytes(device_memory)
        _, peak, intra, inter, lat = PRESETS["h100"]
        self.flops = float(flops) if flops is not None else peak * MFU_DEFAULT
        self.intra_node_bw = float(intra_node_bw) if intra_node_bw is not None else intra * BW_EFFICIENCY
        self.inter_node_bw = float(inter_node_bw) if inter_node_bw is not None else inter * BW_EFFICIENCY
        self.latency = float(latency) if latency is not None else lat
        for name in ("flops", "intra_node_bw", "inter_node_bw"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Cluster: {name} must be > 0, got {getattr(self, name)!r}")
        if self.latency < 0:
            raise ValueError(f"Cluster: latency must be >= 0, got {self.latency!r}")
        self.comm = dict(comm or {})
        self.op_overhead = float(op_overhead)  # host seconds per operator (measured on CPU worlds; 0: hidden)

    @classmethod
    def preset(cls, name: str, world_size: int, devices_per_node: int = 8, **overrides) -> "Cluster":
        """A cluster of ``name`` GPUs (``h100``, ``h200``, ``a100``, ``a100-40gb``, ``b200``): memory, peak
        FLOP/s x ``MFU_DEFAULT``, NVLink / InfiniBand bandwidth x ``BW_EFFICIENCY``."""
        key = name.lower()
        if key not in PRESETS:
            raise ValueError(f"Cluster.preset: unknown name {name!r}; choose from {sorted(PRESETS)}")
        mem, peak, intra, inter, lat = PRESETS[key]
        kw = dict(device_memory=mem, flops=peak * MFU_DEFAULT, intra_node_bw=intra * BW_EFFICIENCY,
                  inter_node_bw=inter * BW_EFFICIENCY, latency=lat)
        kw.update(overrides)
        mem = kw.pop("device_memory")
        return cls(world_size, devices_per_node, mem, **kw)

    # ------------------------------------------------------------------ cost primitives
    def bandwidth(self, intra: bool, kind: Optional[str] = None) -> float:
        if kind and kind in self.comm:
            return self.comm[kind][1]
        return self.intra_node_bw if intra else self.inter_node_bw

    def lat(self, kind: Optional[str] = None) -> float:
        if kind and kind in self.comm:
            return self.comm[kind][0]
        return self.latency

    def collective_time(self, kind: str, nbytes: float, n: int, intra: bool) -> float:
        """Seconds for one collective of ``kind`` over ``n`` ranks; ``nbytes`` is the full (unsharded) buffer
        (all_gather: the output, reduce_scatter: the input, all_reduce: the tensor, all_to_all: this
        rank's send buffer, p2p: the message). Ring algorithms: (n-1)/n of the buffer per rank
        (all_reduce twice), in n-1 steps (2(n-1))."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        bw, lat = self.bandwidth(intra, kind), self.lat(kind)
        if kind == "all_reduce":
            return 2 * (n - 1) * lat + 2 * (n - 1) / n * nbytes / bw
        if kind == "p2p":
            return lat + nbytes / bw
        return (n - 1) * lat + (n - 1) / n * nbytes / bw

    # ------------------------------------------------------------------ calibration
    def measure(self, mesh_or_group=None, *, sizes=(2**14, 2**22), matmul_n=None, repeats=5) -> "Cluster":
        """Calibrate on the launched world (call on every rank): matmul FLOP/s, and latency + bandwidth
        of all_reduce, all_gather, reduce_scatter, all_to_all and p2p over the group (the whole world,
        a process group, or a DeviceMesh's flattened group). Works on gloo/CPU and NCCL.
        Returns a new ``Cluster`` (memory and topology unchanged); every rank gets the same numbers
        (the slowest rank's times)."""
        return _measure(self, mesh_or_group, sizes, matmul_n, repeats)

    def describe(self) -> str:
        nodes = -(-self.world_size // self.devices_per_node)
        return (f"{self.world_size} devices ({nodes} node(s) x {self.devices_per_node}), "
                f"{self.device_memory / 2**30:.1f} GiB each, {self.flops / 1e12:.3g} TFLOP/s, "
                f"intra {self.intra_node_bw / 1e9:.3g} GB/s, inter {self.inter_node_bw / 1e9:.3g} GB/s, "
                f"latency {self.latency * 1e6:.3g} us")


def _group_of(mesh_or_group):
    if mesh_or_group is None:
        return None
    if hasattr(mesh_or_group, "get_group"):  # a DeviceMesh
        mesh = mesh_or_group
        if mesh.ndim > 1:
            mesh = mesh._flatten("_auto_measure") if hasattr(mesh, "_flatten") else mesh
        return mesh.get_group()
    return mesh_or_group


def _fit(points):
    """Least-squares t = a + b * x over (x, t) points -> (a >= 0, 1/b bandwidth)."""
    (x0, t0), (x1, t1) = points[0], points[-1]
    if t1 <= t0:  # noise swamped the size difference: all of the large message's time is bandwidth
        return t0, x1 / t1
    b = (t1 - t0) / max(x1 - x0, 1)
    a = max(t0 - b * x0, 0.0)
    return a, 1.0 / b


def _op_overhead(timed):
    """Seconds per aten op of a tiny MLP's forward + backward (module hooks and autograd included)."""
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
    return timed(step) / max(_Count.n, 1)


def _measure(cluster, mesh_or_group, sizes, matmul_n, repeats):
    if not dist.is_initialized():
        raise RuntimeError("Cluster.measure() needs an initialized process group (torch.distributed."
                           "init_process_group or hyper_parallel.init_device_mesh) on every rank")
    group = _group_of(mesh_or_group)
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    backend = dist.get_backend(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def timed(fn):
        fn()
        sync()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    # matmul throughput
    mn = matmul_n or (4096 if dev.type == "cuda" else 256)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(mn, mn, device=dev, dtype=dt)
    b = torch.randn(mn, mn, device=dev, dtype=dt)
    t_mm = timed(lambda: torch.mm(a, b))
    times = {"matmul": t_mm}
    if dev.type == "cpu":  # eager host cost per operator (module calls, autograd): CPU runs are synchronous
        times["op"] = _op_overhead(timed)
    if n > 1:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"):
            for s in sizes:
                numel = max(s // 4 // n * n, n)
                x = torch.ones(numel, device=dev)
                out = torch.empty_like(x)
                shard = torch.empty(numel // n, device=dev)
                if kind == "all_reduce":
                    fn = lambda: dist.all_reduce(x, group=group)
                elif kind == "all_gather":
                    fn = lambda: dist.all_gather_into_tensor(out, x[: numel // n].contiguous(), group=group)
                elif kind == "reduce_scatter":
                    fn = lambda: dist.reduce_scatter_tensor(shard, x, group=group)
                elif kind == "all_to_all":
                    fn = lambda: dist.all_to_all_single(out, x, group=group)
                else:  # p2p ring: even ranks send first
                    nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]

                    def fn():
                        ops = [dist.P2POp(dist.isend, x, nxt, group), dist.P2POp(dist.irecv, out, prv, group)]
                        for w in dist.batch_isend_irecv(ops):
                            w.wait()
                times[(kind, numel * 4)] = timed(fn)
    # the slowest rank's times, agreed by every rank
    keys = sorted(times, key=str)
    vec = torch.tensor([times[k] for k in keys], dtype=torch.float64)
    if n > 1:
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    times = dict(zip(keys, vec.tolist()))
    flops = 2 * mn**3 / max(times["matmul"], 1e-12)
    comm = {}
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"):
        pts = sorted((k[1], v) for k, v in times.items() if isinstance(k, tuple) and k[0] == kind)
        if len(pts) < 2:
            continue
        # convert to the alpha-beta form of Cluster.collective_time: bytes on the wire per rank / bw
        if kind == "all_reduce":
            pts = [(2 * (n - 1) / n * s, t) for s, t in pts]
            steps = 2 * (n - 1)
        elif kind == "p2p":
            steps = 1
        else:
            pts = [((n - 1) / n * s, t) for s, t in pts]
            steps = n - 1
        a, bw = _fit(pts)
        comm[kind] = (a / steps, bw)
    ar = comm.get("all_reduce", (cluster.latency, cluster.intra_node_bw))
    bw = ar[1]
    return Cluster(cluster.world_size, cluster.devices_per_node, cluster.device_memory, flops=flops,
                   intra_node_bw=bw, inter_node_bw=bw if cluster.world_size <= cluster.devices_per_node
                   else min(bw, cluster.inter_node_bw), latency=ar[0], comm=comm, op_overhead=times.get("op", 0.0))
