"""``Cluster``: what the planner knows about the machines (sizes, memory, speeds) and ``measure()``.

Speeds are alpha-beta: a collective over a group moves ``bytes_on_wire`` at ``bandwidth`` (intra- or
inter-node, bytes/s per rank) after ``latency`` seconds per message step. ``flops`` is the sustained
matmul throughput of one device (FLOP/s). Presets (``Cluster.preset``) are vendor peak figures
scaled by documented efficiencies (docs/auto_parallel.md "Calibration").
"""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, Optional

import torch
import torch.distributed as dist

from hyper_parallel.auto.calibrate import KINDS, wire_bytes

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


# name: (memory bytes, dense bf16 FLOP/s peak, intra-node bytes/s, inter-node bytes/s, latency s, HBM bytes/s)
# Peak figures from the vendors' data sheets. The planner's kernel rates are KERNEL_EFFICIENCY of the peak
# (matmul, fused attention), its links run at BW_EFFICIENCY of the data-sheet bandwidth, its memory-bound ops
# at HBM_EFFICIENCY of the HBM bandwidth (docs/auto_parallel.md "Cost model" cites the sources).
PRESETS: Dict[str, tuple] = {
    "h100": (80 * 2**30, 989e12, 450e9, 50e9, 10e-6, 3.35e12),    # H100 SXM, NVLink4 900 GB/s bidir, 400 Gb/s IB
    "h200": (141 * 10**9, 989e12, 450e9, 50e9, 10e-6, 4.8e12),    # H200 SXM: H100 compute, 141 GB HBM3e
    "a100": (80 * 2**30, 312e12, 300e9, 25e9, 10e-6, 2.039e12),   # A100 SXM 80GB, NVLink3 600 GB/s bidir, 200 Gb/s IB
    "a100-40gb": (40 * 2**30, 312e12, 300e9, 25e9, 10e-6, 1.555e12),
    "b200": (180 * 10**9, 2250e12, 900e9, 50e9, 10e-6, 8.0e12),   # B200: NVLink5 1.8 TB/s bidir
}
# sustained fraction of the dense peak reached by large bf16 GEMMs and by causal fused (flash) attention,
# forward + backward, per generation (published kernel benchmarks: docs/auto_parallel.md)
KERNEL_EFFICIENCY: Dict[str, tuple] = {
    "h100": (0.70, 0.45), "h200": (0.70, 0.45), "a100": (0.65, 0.55), "a100-40gb": (0.65, 0.55),
    "b200": (0.70, 0.45),
}
HBM_EFFICIENCY = 0.8
BW_EFFICIENCY = 0.8
LAUNCH_OVERHEAD = 5e-6   # seconds of host time per eager kernel launch (hidden unless kernels are shorter)
MAX_MFU = 0.6            # no plan is predicted above this model-FLOPs utilisation (a prediction that is, is a bug)


@dataclasses.dataclass
class Cluster:
    """``world_size`` devices, ``devices_per_node`` per node, ``device_memory`` each (bytes or "80GiB").

    ``flops`` (the matmul kernel rate: sustained FLOP/s per device), ``peak_flops`` (the data sheet's dense
    peak; MFU and the physics floor of every prediction use it; default ``flops``), ``attention_flops`` (the
    fused attention kernel rate; default ``flops``), ``hbm_bw`` (bytes/s of the memory-bound ops; None: not
    modelled), ``launch`` (host seconds per kernel launch on a device), ``intra_node_bw`` / ``inter_node_bw``
    (bytes/s per rank on the wire) and ``latency`` (s per message step) default to the H100 preset's values.
    ``comm_by_size`` (filled by :meth:`measure`) holds the measured fits ``(kind, n)`` -> (seconds per call,
    bytes/s on the wire) for each calibrated group size ``n``; ``comm`` ``kind`` -> (seconds per message
    step, bytes/s) for other sizes (from the largest measured group). ``op_overhead``, ``ac_op``, ``dtensor_op``, ``optim`` and ``fsdp_unit`` are the host
    costs of the library's execution (docs/auto_parallel.md "Calibration"); 0 on device clusters.
    """

    world_size: int
    devices_per_node: int
    device_memory: int
    flops: Optional[float] = None
    intra_node_bw: Optional[float] = None
    inter_node_bw: Optional[float] = None
    latency: Optional[float] = None
    comm: Dict[str, tuple] = dataclasses.field(default_factory=dict)
    comm_by_size: Dict[tuple, tuple] = dataclasses.field(default_factory=dict)
    op_overhead: float = 0.0
    ac_op: float = 0.0
    dtensor_op: float = 0.0
    optim: tuple = (0.0, 0.0)
    fsdp_unit: Dict[int, float] = dataclasses.field(default_factory=dict)
    peak_flops: Optional[float] = None
    attention_flops: Optional[float] = None
    hbm_bw: Optional[float] = None
    launch: float = 0.0
    peak_known: bool = False

    def __init__(self, world_size, devices_per_node, device_memory, *, flops=None, intra_node_bw=None,
                 inter_node_bw=None, latency=None, comm=None, comm_by_size=None, op_overhead=0.0, ac_op=0.0, dtensor_op=0.0,
                 optim=(0.0, 0.0), fsdp_unit=None, peak_flops=None, attention_flops=None, hbm_bw=None, launch=None):
        for name, v in (("world_size", world_size), ("devices_per_node", devices_per_node)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Cluster: {name} must be a positive int, got {v!r}")
        self.world_size, self.devices_per_node = world_size, devices_per_node
        self.device_memory = parse_bytes(device_memory)
        _, peak, intra, inter, lat, hbm = PRESETS["h100"]
        mm_eff, attn_eff = KERNEL_EFFICIENCY["h100"]
        default = flops is None
        self.flops = float(flops) if flops is not None else peak * mm_eff
        self.peak_flops = float(peak_flops) if peak_flops is not None else peak if default else self.flops
        # a data-sheet peak (a preset, or given): plans are then held to MAX_MFU of it
        self.peak_known = peak_flops is not None or default
        self.attention_flops = (float(attention_flops) if attention_flops is not None
                                else peak * attn_eff if default else self.flops)
        self.hbm_bw = float(hbm_bw) if hbm_bw is not None else hbm * HBM_EFFICIENCY if default else None
        self.launch = float(launch) if launch is not None else LAUNCH_OVERHEAD if default else 0.0
        self.intra_node_bw = float(intra_node_bw) if intra_node_bw is not None else intra * BW_EFFICIENCY
        self.inter_node_bw = float(inter_node_bw) if inter_node_bw is not None else inter * BW_EFFICIENCY
        self.latency = float(latency) if latency is not None else lat
        if self.peak_flops < self.flops or self.peak_flops < self.attention_flops:
            raise ValueError(f"Cluster: peak_flops={self.peak_flops!r} is below the kernel rate flops={self.flops!r} "
                             f"/ attention_flops={self.attention_flops!r}; the peak bounds every kernel")
        for name in ("flops", "intra_node_bw", "inter_node_bw", "attention_flops"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Cluster: {name} must be > 0, got {getattr(self, name)!r}")
        if self.latency < 0:
            raise ValueError(f"Cluster: latency must be >= 0, got {self.latency!r}")
        self.comm = dict(comm or {})
        self.comm_by_size = dict(comm_by_size or {})
        # host costs, measured on CPU worlds (0 where the host runs ahead of the device: hidden)
        self.op_overhead = float(op_overhead)    # seconds per aten op (forward or backward)
        self.ac_op = float(ac_op)                # extra seconds per forward op under activation checkpointing
        self.dtensor_op = float(dtensor_op)      # extra seconds per op dispatched on a DTensor
        self.optim = tuple(float(v) for v in optim)  # AdamW seconds per parameter tensor: (plain, DTensor)
        self.fsdp_unit = dict(fsdp_unit or {})   # group size -> seconds per fully_shard unit per step

    @classmethod
    def preset(cls, name: str, world_size: int, devices_per_node: int = 8, **overrides) -> "Cluster":
        """A cluster of ``name`` GPUs (``h100``, ``h200``, ``a100``, ``a100-40gb``, ``b200``): memory, peak
        FLOP/s, kernel rates (``KERNEL_EFFICIENCY`` x peak), HBM bandwidth x ``HBM_EFFICIENCY``, NVLink /
        InfiniBand bandwidth x ``BW_EFFICIENCY``, ``LAUNCH_OVERHEAD`` per kernel."""
        key = name.lower()
        if key not in PRESETS:
            raise ValueError(f"Cluster.preset: unknown name {name!r}; choose from {sorted(PRESETS)}")
        mem, peak, intra, inter, lat, hbm = PRESETS[key]
        mm_eff, attn_eff = KERNEL_EFFICIENCY[key]
        kw = dict(device_memory=mem, flops=peak * mm_eff, peak_flops=peak, attention_flops=peak * attn_eff,
                  hbm_bw=hbm * HBM_EFFICIENCY, launch=LAUNCH_OVERHEAD, intra_node_bw=intra * BW_EFFICIENCY,
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

    def collective_time(self, kind: str, nbytes: float, group_size: int, intra: bool) -> float:
        """Seconds for one collective of ``kind`` over ``group_size`` (n) ranks; ``nbytes`` is the full (unsharded)
        buffer (all_gather: the output, reduce_scatter: the input, all_reduce: the tensor, all_to_all: this
        rank's send buffer, p2p: the message). Ring algorithms: (n-1)/n of the buffer per rank
        (all_reduce twice), in n-1 steps (2(n-1))."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        fit = self.comm_by_size.get((kind, group_size))
        if fit is not None:  # measured at this group size: seconds per call + wire bytes / bandwidth
            return fit[0] + wire_bytes(kind, nbytes, group_size) / fit[1]
        bw, lat = self.bandwidth(intra, kind), self.lat(kind)
        if kind == "all_reduce":
            return 2 * (group_size - 1) * lat + 2 * (group_size - 1) / group_size * nbytes / bw
        if kind == "p2p":
            return lat + nbytes / bw
        return (group_size - 1) * lat + (group_size - 1) / group_size * nbytes / bw

    # ------------------------------------------------------------------ calibration
    def measure(self, mesh_or_group=None, *, sizes=(2**12, 2**20), matmul_n=None, repeats=7) -> "Cluster":
        """Calibrate on the launched world (call on every rank): matmul FLOP/s, and seconds per call +
        bandwidth of all_reduce, all_gather, reduce_scatter, all_to_all and p2p over groups of every
        power-of-two size up to 8 (the whole world; a process group or a DeviceMesh's flattened group:
        its own size), through the library's collectives. On CPU worlds also the host costs: per aten op,
        per DTensor-dispatched op, per AdamW parameter, per ``fully_shard`` unit. All ranks time at once
        (the cores are shared as in a step); medians; every rank gets the slowest rank's numbers.
        Works on gloo/CPU and NCCL. Returns a new ``Cluster`` (memory and topology unchanged)."""
        return _measure(self, mesh_or_group, sizes, matmul_n, repeats)

    def describe(self) -> str:
        nodes = -(-self.world_size // self.devices_per_node)
        return (f"{self.world_size} devices ({nodes} node(s) x {self.devices_per_node}), "
                f"{self.device_memory / 2**30:.1f} GiB each, {self.flops / 1e12:.3g} TFLOP/s matmul "
                f"(peak {self.peak_flops / 1e12:.3g}), "
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


def _measure(cluster, mesh_or_group, sizes, matmul_n, repeats):
    from hyper_parallel.auto.calibrate import measure_world
    if not dist.is_initialized():
        raise RuntimeError("Cluster.measure() needs an initialized process group (torch.distributed."
                           "init_process_group or hyper_parallel.init_device_mesh) on every rank")
    group = _group_of(mesh_or_group)
    backend = dist.get_backend(group)
    r = measure_world(group, sizes=sizes, matmul_n=matmul_n, repeats=repeats, with_host=backend != "nccl")
    comm = {}
    # per-step alpha-beta for group sizes not measured: from the largest measured group of each kind
    for kind in KINDS:
        fits = sorted((n, v) for (k, n), v in r["comm"].items() if k == kind)
        if fits:
            n, (a, bw) = fits[-1]
            steps = 1 if kind == "p2p" else 2 * (n - 1) if kind == "all_reduce" else n - 1
            comm[kind] = (a / steps, bw)
    ar = comm.get("all_reduce", (cluster.latency, cluster.intra_node_bw))
    bw = ar[1]
    return Cluster(cluster.world_size, cluster.devices_per_node, cluster.device_memory, flops=r["flops"],
                   intra_node_bw=bw, inter_node_bw=bw if cluster.world_size <= cluster.devices_per_node
                   else min(bw, cluster.inter_node_bw), latency=ar[0], comm=comm, comm_by_size=r["comm"],
                   op_overhead=r["op_overhead"],
                   ac_op=r["ac_op"], dtensor_op=r["dtensor_op"], optim=r["optim"], fsdp_unit=r["fsdp_unit"])
