"""``Plan``: one parallel layout with its predicted memory and step time, ``explain()``, ``to_args()``, ``apply()``."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

GiB = 2**30
DEGREE_KEYS = ("dp", "fsdp", "tp", "pp", "cp", "ep")


@dataclasses.dataclass
class Memory:
    """Per-rank bytes, the maximum over ranks (pipeline stages differ)."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    buffers: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def state(self) -> int:
        """params + grads + optimizer (exact for plans without pp / ep)."""
        return self.params + self.grads + self.optimizer


@dataclasses.dataclass
class StepTime:
    """Seconds per training step: compute, exposed communication (``comm_per_dim`` splits it), bubble."""

    compute: float = 0.0
    comm: float = 0.0
    bubble: float = 0.0
    comm_per_dim: Dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.compute + self.comm + self.bubble


@dataclasses.dataclass
class Plan:
    degrees: Dict[str, int]
    sequence_parallel: bool
    activation_checkpointing: str          # "none" | "full" (per block) | "selective"
    pp_schedule: Optional[str]
    microbatches: int
    layers_per_stage: List[int]
    cp_method: Optional[str]
    memory: Memory
    step_time: StepTime
    mesh_shape: Tuple[int, ...]
    mesh_dim_names: Tuple[str, ...]
    world_size: int
    global_batch: int
    seq_len: int
    param_dtype: object = None
    reduce_dtype: object = None
    device_memory: int = 0
    fits: bool = True
    _model_info: object = dataclasses.field(default=None, repr=False, compare=False)
    stages_per_rank: int = 1               # pipeline stages per rank (2+ for interleaved schedules)
    per_rank: List[dict] = dataclasses.field(default_factory=list, repr=False, compare=False)
    model_flops: float = 0.0               # FLOPs of one step of the model (forward + backward, no recompute)
    peak_flops: float = 0.0                # per device (the cluster's data-sheet peak)
    recompute_layers: Optional[int] = None  # AC "full" on the first k blocks of every stage only (None: all)

    @property
    def state_max(self) -> int:
        """params + grads + optimizer bytes of the rank holding the most of them (pipeline ranks differ; ``memory``
        is the rank with the largest total)."""
        return max((x["memory"].state for x in self.per_rank), default=self.memory.state)

    @property
    def mfu(self) -> float:
        """Model-FLOPs utilisation: model FLOPs per step / (step time x world x peak FLOP/s)."""
        t = self.step_time.total
        return self.model_flops / (t * self.world_size * self.peak_flops) if t > 0 and self.peak_flops else 0.0

    # ------------------------------------------------------------------ reading
    def summary(self) -> str:
        d = self.degrees
        parts = [f"{k}{d[k]}" for k in DEGREE_KEYS if d[k] > 1] or ["single"]
        s = " x ".join(parts)
        if self.sequence_parallel:
            s += " +sp"
        if d["pp"] > 1:
            s += f" {self.pp_schedule}/m{self.microbatches}"
        if d["cp"] > 1:
            s += f" cp:{self.cp_method}"
        if self.activation_checkpointing != "none":
            s += f" ac:{self.activation_checkpointing}"
            if self.activation_checkpointing == "full" and self.recompute_layers is not None:
                s += f"[{self.recompute_layers}/stage]"
        return s

    def explain(self) -> str:
        """A table a person reads in 10 seconds."""
        m, t = self.memory, self.step_time
        unit, div = ("GiB", GiB) if m.total >= GiB / 4 else ("MiB", 2**20) if m.total >= 2**18 else ("KiB", 1024)
        g = lambda nbytes: f"{nbytes / div:8.2f} {unit}"
        ms = lambda seconds: f"{seconds * 1e3:10.3f} ms"
        d = self.degrees
        lines = [
            f"plan: {self.summary()}   (world {self.world_size}, batch {self.global_batch} x {self.seq_len})",
            f"  mesh        {dict(zip(self.mesh_dim_names, self.mesh_shape))}",
            "  degrees     " + "  ".join(f"{k}={d[k]}" for k in DEGREE_KEYS),
            f"  choices     sp={'on' if self.sequence_parallel else 'off'}  ac={self.activation_checkpointing}"
            + (f"  pp={self.pp_schedule} microbatches={self.microbatches} layers/stage={self.layers_per_stage}"
               if d["pp"] > 1 else "") + (f"  cp={self.cp_method}" if d["cp"] > 1 else ""),
            "  memory/rank params " + g(m.params) + " | grads " + g(m.grads) + " | optimizer " + g(m.optimizer),
            "              activ. " + g(m.activations) + " | buffers " + g(m.buffers) + " | TOTAL " + g(m.total)
            + f" of {self.device_memory / div:.1f} {unit}" + ("" if self.fits else "  (DOES NOT FIT)"),
            "  step time   compute" + ms(t.compute) + " | comm" + ms(t.comm) + " | bubble" + ms(t.bubble)
            + " | TOTAL" + ms(t.total),
        ]
        if t.comm_per_dim:
            lines.append("  exposed comm per dim  " + "  ".join(f"{k}={v * 1e3:.2f}ms" for k, v in t.comm_per_dim.items()))
        if self.model_flops:
            lines.append(f"  model FLOPs {self.model_flops:.4g} per step: "
                         f"{self.model_flops / max(t.total, 1e-30) / self.world_size / 1e12:.4g} TFLOP/s per device, "
                         f"MFU {self.mfu:.1%}")
        if len(self.per_rank) > 1:
            lines.append("  pipeline ranks (step time = the slowest rank's busy time + bubble; memory = the largest; "
                         "a row stands for ranks alike, its first rank holds the most microbatches):")
            lines.append("    ranks      stages      blocks        in-flight   memory        compute      comm")
            for x in self.per_rank:
                rs = x.get("ranks", [x["rank"]])
                who = f"{rs[0]}" if len(rs) == 1 else f"{rs[0]}-{rs[-1]}" if rs == list(range(rs[0], rs[-1] + 1)) \
                    else ",".join(map(str, rs))
                lines.append(f"    {who:9s}  {','.join(map(str, x['stages'])):10s}  "
                             f"{','.join(map(str, x['blocks'])):12s}  {x['in_flight']:9.2f}  "
                             f"{x['memory'].total / div:8.2f} {unit}  " + ms(x["compute"]) + " " + ms(sum(x["comm"].values())))
        return "\n".join(lines)

    def __str__(self):
        return self.explain()

    def to_args(self) -> List[str]:
        """The example's command line (``examples/llama/train.py``) for this plan (activation checkpointing, which
        the example has no flag for, is left out)."""
        d = self.degrees
        args = []
        if d["dp"] > 1:
            args += ["--dp", str(d["dp"])]
        if d["fsdp"] > 1:
            args += ["--dp-shard", str(d["fsdp"])]
        if d["tp"] > 1:
            args += ["--tp", str(d["tp"])]
        if self.sequence_parallel:
            args += ["--sp"]
        if d["pp"] > 1:
            args += ["--pp", str(d["pp"]), "--pp-schedule", str(self.pp_schedule),
                     "--pp-microbatches", str(self.microbatches)]
        if d["cp"] > 1:
            args += ["--cp", str(d["cp"]), "--cp-method", str(self.cp_method)]
        if d["ep"] > 1:
            args += ["--ep", str(d["ep"])]
        # activation checkpointing has no flag in the example: explain() shows it, apply() applies it
        return args

    def coordinates(self, rank: int) -> Dict[str, int]:
        """This global rank's index on every mesh dim (row-major mesh, as ``init_device_mesh`` lays it out)."""
        out, r = {}, rank
        for name, size in reversed(list(zip(self.mesh_dim_names, self.mesh_shape))):
            out[name] = r % size
            r //= size
        return out

    def data_shard(self, rank: int) -> Tuple[int, int]:
        """(index, count) of this rank's share of the global batch: the batch is split over dp x fsdp
        (ep borrows fsdp ranks; tp and cp ranks of one data-parallel rank get the same samples)."""
        c = self.coordinates(rank)
        idx, n = 0, 1
        for name, size in zip(self.mesh_dim_names, self.mesh_shape):
            if name in ("dp", "fsdp", "efsdp", "ep"):
                idx, n = idx * size + c[name], n * size
        return idx, n

    def shard_batch(self, inputs, targets, rank: Optional[int] = None):
        """This rank's share of a global batch ``inputs``, ``targets`` (``[global_batch, seq_len]``): its data-parallel
        rows (:meth:`data_shard`) and, with context parallelism, its load-balanced sequence positions (head-tail
        chunks, as :meth:`apply`, which must have run first in this process, cut the rotary tables)."""
        import torch.distributed as dist
        rank = dist.get_rank() if rank is None else rank
        idx, n = self.data_shard(rank)
        b = inputs.shape[0] // n
        inputs, targets = inputs[idx * b:(idx + 1) * b], targets[idx * b:(idx + 1) * b]
        if self.degrees["cp"] > 1:
            mesh = self.__dict__.get("_cp_mesh")
            if mesh is None:
                raise RuntimeError("Plan.shard_batch: a context-parallel plan cuts the sequence over its cp mesh; "
                                   "call plan.apply(model) in this process first")
            from hyper_parallel.context_parallel import cp_shard
            inputs, targets = cp_shard(mesh, [inputs, targets], [1, 1], load_balance=True)
        return inputs, targets

    # ------------------------------------------------------------------ doing
    def apply(self, model, *, roles=None, device_type: str = "cpu", loss_fn=None):
        """Build the mesh and parallelize ``model`` (call on every rank of the launched world): returns the
        module, or, with a pipeline, the schedule (torch's ``step(x, target=y, losses=[])``; ``loss_fn(output,
        target)``, default cross-entropy). Feed it :meth:`shard_batch` of each global batch. See
        ``hyper_parallel.auto.apply``."""
        from hyper_parallel.auto.apply import apply_plan
        return apply_plan(self, model, roles=roles, device_type=device_type, loss_fn=loss_fn)
