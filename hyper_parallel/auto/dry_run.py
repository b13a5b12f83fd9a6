"""``dry_run(plan, model_fn, world_size=W)``: one real training step of one rank of a W-rank job, in this
process, under torch's fake process group (collectives return without moving data).

For each rank role that differs (rank 0, which holds the largest ``torch.chunk`` shards, and the last rank,
which holds the smallest; with a pipeline the first rank of every stage) it builds the model with
``model_fn()``, applies the plan, runs one step (creating the optimizer states), and then measures a second
step (forward, backward, AdamW; gradients freed before it as ``zero_grad`` does) under
a live-storage tracker (a ``TorchDispatchMode`` that adds the bytes of every new tensor storage and
subtracts them when the storage is freed; the peak over the step) and
``hyper_parallel.CommDebugMode`` (every collective the library issues with its bytes and group).

Pipelines: ``Plan.apply`` builds the stages in torch's static mode (boundary shapes from the layout), so
nothing but activations and gradients crosses the stages. Under the fake group the stage's first-step
handshake (torch's static/dynamic vote and our boundary check, both point to point) is skipped and its
receive buffers are zeros (the fake group's receives leave them as they are): the stage runs its real
forward, backward and collectives on them. Context parallelism runs as is: the ring's receives leave
zeros too, which changes values, not sizes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import hyper_parallel as hp
from hyper_parallel.dispatch.modes import reset_process_state




@dataclasses.dataclass
class RankReport:
    rank: int
    role: str
    peak_memory: int                       # bytes: parameters + buffers + optimizer states + the step's peak of new storages
    state_bytes: int                       # params + grads + optimizer states after the step (local shards)
    collectives: List[tuple]               # (kind, bytes sent by this rank, group size) in issue order
    counts: Dict[str, int]
    bytes: Dict[str, int]


@dataclasses.dataclass
class DryRunResult:
    world_size: int
    ranks: Dict[int, RankReport]

    @property
    def peak_memory(self) -> int:
        return max(r.peak_memory for r in self.ranks.values())

    def __str__(self):
        out = [f"dry run at world {self.world_size}:"]
        for r in self.ranks.values():
            out.append(f"  rank {r.rank} ({r.role}): peak {r.peak_memory / 2**20:.2f} MiB, state "
                       f"{r.state_bytes / 2**20:.2f} MiB, collectives {dict(r.counts)} bytes {dict(r.bytes)}")
        return "\n".join(out)


def _roles(plan, world_size):
    if plan.degrees["pp"] > 1:
        per = world_size // plan.degrees["pp"]
        return {s * per: f"stage {s}" + (" (first)" if s == 0 else " (last)" if s == plan.degrees["pp"] - 1 else "")
                for s in range(plan.degrees["pp"])}
    out = {0: "rank 0 (largest shards)"}
    if world_size > 1:
        out[world_size - 1] = "last rank (smallest shards)"
    return out


def _default_batch(plan, rank, vocab):
    idx, n = plan.data_shard(rank)
    b = plan.global_batch // n
    g = torch.Generator().manual_seed(idx)
    x = torch.randint(0, vocab, (b, plan.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _cp_cut(plan, inputs, targets):
    """This cp rank's load-balanced sequence positions of a data-parallel share (no-op without cp)."""
    if plan.degrees["cp"] == 1:
        return inputs, targets
    from hyper_parallel.context_parallel import cp_shard
    return tuple(cp_shard(plan.__dict__["_cp_mesh"], [inputs, targets], [1, 1], load_balance=True))


def _fake_world_stage_cls():
    """``PipelineStage`` for the fake group: no first-step handshake, zeroed receive buffers."""
    from hyper_parallel.pipelining import PipelineStage

    class FakeWorldStage(PipelineStage):
        def _warmup_forward_vote(self, has_backward, received_acc=None):
            return torch.ones(1, dtype=torch.int32)   # every stage is static (Plan.apply gives the shapes)

        def _warmup_backward_result(self, received_result=None):
            return torch.ones(1, dtype=torch.int32)

        def _hp_static_boundary_check(self):
            return None                                 # the neighbours' declared shapes are ours by construction

        def _setup_forward_recv_info(self, num_microbatches, has_backward):
            super()._setup_forward_recv_info(num_microbatches, has_backward)
            for infos in self.args_recv_info.values():
                for info in infos:
                    if isinstance(getattr(info, "buffer", None), torch.Tensor):
                        info.buffer.zero_()

        def _setup_backward_recv_info(self, num_microbatches):
            super()._setup_backward_recv_info(num_microbatches)
            for infos in self.grad_recv_info.values():
                for info in infos:
                    if isinstance(getattr(info, "buffer", None), torch.Tensor):
                        info.buffer.zero_()
    return FakeWorldStage


def _loss(out, targets):
    from hyper_parallel.auto.hf_adapt import output_logits
    out = output_logits(out)  # HF's CausalLMOutputWithPast: its logits
    out = out.full_tensor() if isinstance(out, hp.DTensor) else out
    return torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), targets.flatten())


def dry_run(plan, model_fn: Callable[[], torch.nn.Module], *, world_size: Optional[int] = None,
            rank: Optional[int] = None, batch_fn=None, loss_fn=None, lr: float = 1e-3) -> DryRunResult:
    """Run one training step of ``rank`` (default: every differing rank role) of a ``world_size``-rank job
    laid out by ``plan``, in this process on the fake process group. ``model_fn()`` builds the model
    (the same on every rank); ``batch_fn(plan, rank)`` gives this rank's data-parallel (inputs, targets) (cut over cp here; default: random
    token ids of the plan's batch share); ``loss_fn(output, targets)`` (default: cross-entropy); ``lr``: AdamW's
    learning rate (``torch.optim``'s keyword)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    W = plan.world_size if world_size is None else world_size
    if W != plan.world_size:
        raise ValueError(f"dry_run: world_size={W} differs from the plan's world size {plan.world_size}")
    if dist.is_initialized():
        raise RuntimeError("dry_run: a process group is already initialized in this process; dry_run creates its "
                           "own fake one per rank (run it in a fresh process)")
    if rank is not None and not 0 <= rank < W:
        raise ValueError(f"dry_run: rank={rank} is not in [0, {W})")
    roles = {rank: f"rank {rank}"} if rank is not None else _roles(plan, W)
    reports = {}
    for r, role in roles.items():
        dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=W)
        try:
            with _works_hold_tensors():
                reports[r] = _one_rank(plan, model_fn, r, role, batch_fn, loss_fn or _loss, lr, fake=True)
        finally:
            _release_groups()
            dist.destroy_process_group()
            reset_process_state()
    return DryRunResult(W, reports)


def _release_groups():
    """Forget the library's cached process groups of the previous fake world (the next rank builds its own),
    and the layouts and dispatch entries built on its meshes: a mesh of the next world with the same ranks
    and names compares equal to the old one, and a cached layout would hand it the old world's groups."""
    from hyper_parallel.dispatch import dispatcher
    from hyper_parallel.distributed import groups
    from hyper_parallel.dtensor import layout_builder
    groups.release_groups()
    layout_builder._LAYOUT_CACHE.clear()
    dispatcher._clear_caches()


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, hp.DTensor) else tensor


class LiveBytes(TorchDispatchMode):
    """Bytes of live tensor storages created under this mode (current and peak)."""

    def __init__(self):
        super().__init__()
        self.live = {}
        self.current = 0
        self.peak = 0

    def _track(self, tensor):
        try:
            st = tensor.untyped_storage()
            key, n = st._cdata, st.nbytes()
        except Exception:  # noqa: BLE001 - wrapper subclasses without storage
            return
        if key in self.live or st.device.type == "meta":
            return
        self.current += n
        self.peak = max(self.peak, self.current)

        def freed(_ref, key=key, nbytes=n):
            if key in self.live:
                del self.live[key]
                self.current -= nbytes
        self.live[key] = weakref.ref(st, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


class _HeldWork:
    """A fake group's ``Work`` that keeps the collective's tensors alive until its holder drops it, as a real
    backend's work does (gloo's and NCCL's hold their inputs and outputs): a schedule or kernel that keeps a
    work a while keeps those tensors with it, which is part of the real peak."""

    def __init__(self, work, args):
        self._work, self._args = work, args

    def wait(self, *args, **kwargs):
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


_PG_CALLS = ("_allgather_base", "_reduce_scatter_base", "all_gather_single", "all_gather_single_coalesced",
             "all_to_all_single", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced", "allreduce",
             "allreduce_coalesced", "alltoall", "alltoall_base", "broadcast", "gather", "recv", "reduce",
             "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
             "reduce_scatter_tensor_coalesced", "scatter", "send")


@contextlib.contextmanager
def _works_hold_tensors():
    """While dry-running: every ``ProcessGroup`` call's work holds the call's tensors (see ``_HeldWork``)."""
    from torch._C._distributed_c10d import ProcessGroup
    saved = {}
    for name in _PG_CALLS:
        # keep the class's own attribute (pybind's method descriptor) to put back: getattr returns the bare
        # builtin, which as a class attribute no longer binds ``self``, so every later call on any group in
        # this process (and in processes forked from it) would fail with "incompatible function arguments"
        raw = ProcessGroup.__dict__.get(name)
        if raw is None:
            continue
        orig = getattr(ProcessGroup, name)
        saved[name] = raw

        def held(self, *args, __orig=orig, **kwargs):
            return _HeldWork(__orig(self, *args, **kwargs), args)
        setattr(ProcessGroup, name, held)
    try:
        yield
    finally:
        for name, orig in saved.items():
            setattr(ProcessGroup, name, orig)


@contextlib.contextmanager
def _p2p_events(events):
    """Pipeline point-to-point messages (torch's schedules batch them in ``_batch_p2p``) as ``("send" | "recv",
    bytes, 2)`` events, in issue order with the collectives."""
    from torch.distributed.pipelining import schedules as sch
    orig = sch._batch_p2p

    def logged(p2p_ops, desc=None):
        for op in p2p_ops:
            events.append(("send" if op.op is dist.isend else "recv", op.tensor.numel() * op.tensor.element_size(),
                           (0, 1)))
        return orig(p2p_ops, desc)
    sch._batch_p2p = logged
    try:
        yield
    finally:
        sch._batch_p2p = orig


def measure_step(plan, model_fn, *, role: str = "", batch_fn=None, loss_fn=None, lr: float = 1e-3) -> RankReport:
    """One training step of this rank of the launched (real or fake) world under ``plan``: the report
    ``dry_run`` gives, measured the same way, so a real multi-process run compares one to one."""
    return _one_rank(plan, model_fn, dist.get_rank(), role or f"rank {dist.get_rank()}", batch_fn,
                     loss_fn or _loss, lr)


def _one_rank(plan, model_fn, rank, role, batch_fn, loss_fn, learning_rate, fake=False):
    from hyper_parallel.auto.apply import apply_plan
    pp = plan.degrees["pp"] > 1
    if batch_fn is not None:
        x, y = batch_fn(plan, rank)
    else:
        x, y = _default_batch(plan, rank, plan._model_info.vocab)
    if pp:  # the schedule: this rank's stage modules; their forward and backward inside step()
        sched = apply_plan(plan, model_fn(), loss_fn=loss_fn, stage_cls=_fake_world_stage_cls() if fake else None)
        x, y = _cp_cut(plan, x, y)
        modules = sched.stage_modules
        params = [p for m in modules for p in m.parameters()]

        def step():
            sched.step(*((x,) if sched.has_first else ()), target=y if sched.has_last else None,
                       losses=[] if sched.has_last else None)
    else:
        model = apply_plan(plan, model_fn())
        x, y = _cp_cut(plan, x, y)
        modules = [model]
        params = list(model.parameters())

        def step():
            loss_fn(model(x), y).backward()
    opt = torch.optim.AdamW(params, lr=learning_rate)
    # a first step creates the optimizer states (the steady state of training); the second is measured
    step()
    opt.step()
    opt.zero_grad(set_to_none=True)
    # live before the measured step: this rank's parameters (local shards), buffers and optimizer states
    base = {}
    live = params + [b for m in modules for b in m.buffers()]
    live += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    for t in live:
        t = _local(t)
        base[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    mt = LiveBytes()
    mt.live.update({k: None for k in base})
    with mt:
        with hp.CommDebugMode() as comm, _p2p_events(comm.events):
            step()
            opt.step()
    peak = sum(base.values()) + mt.peak
    state = 0
    for p in params:
        state += _local(p).numel() * _local(p).element_size()
        if p.grad is not None:
            state += _local(p.grad).numel() * _local(p.grad).element_size()
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                state += _local(v).numel() * _local(v).element_size()
    events = [(k, int(b), len(g) if g is not None else 0) for k, b, g in comm.events]
    counts, nbytes = dict(comm.get_comm_counts()), comm.get_bytes()
    for k, b, _ in events:
        if k in ("send", "recv"):
            counts[k] = counts.get(k, 0) + 1
            nbytes[k] = nbytes.get(k, 0) + b
    return RankReport(rank, role, int(peak), state, events, counts, nbytes)
