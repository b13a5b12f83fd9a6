"""A ``fully_shard`` group: one flat all_gather per unshard, one flat reduce_scatter per backward.

The group owns the parameters of one ``fully_shard`` call. ``unshard()`` packs
every parameter's shard into one flat per-rank buffer (copy-in), issues one
asynchronous ``all_gather_into_tensor`` and returns; ``wait_for_unshard()``
waits on the work handle, copies each parameter's rows out of the gathered
buffer into its unsharded tensor and points the owning modules at the
unsharded tensors. Issuing and waiting are separate so the next group's
all_gather can be in flight while this group computes (prefetch).

``reduce_grads()`` packs the unsharded gradients into one flat ``(k, S)``
buffer and issues one asynchronous ``reduce_scatter``; the root's end-of-backward
callback calls ``finish_reduce()`` which waits, all-reduces over the HSDP
replicate group (one collective), divides by the data-parallel size and adds
each parameter's rows to its sharded gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hyper_parallel.distributed import comm_record as rec
from hyper_parallel.distributed.collective_errors import CHECK as _CHECK
from hyper_parallel.distributed import collective_guard as _fault
from hyper_parallel.distributed.collectives import _all_gather_single, _reduce_scatter_single

_AG, _RS, _AR = "FSDP all_gather (unshard)", "FSDP reduce_scatter (gradients)", "FSDP gradient all_reduce"
_RAR = "HSDP replicate all_reduce (gradients)"

SHARDED, UNSHARDING, UNSHARDED = "sharded", "unsharding", "unsharded"


def _free_now(*tensors):
    """Free the storage of finished collectives' CPU buffers here and now.

    Once ``wait()`` returned, gloo no longer reads or writes them, but its work object (and so the
    last reference) may be dropped later by one of gloo's threads; the memory then stays in use
    until that thread gets to it (and the CPU allocator's profiler, which records this thread, never
    sees the free). Resizing the storage to 0 frees it at a fixed point of the step instead.
    Only for buffers this group allocated and no longer needs; CUDA buffers are left to the caching
    allocator's stream-ordered frees.
    """
    for t in tensors:
        if t is not None and t.device.type == "cpu":
            t.untyped_storage().resize_(0)


def gloo_cpu(group, inp) -> bool:
    """Whether the group's collectives on ``inp`` (a CPU buffer the caller owns) run on gloo.

    gloo implements two of FSDP's collectives with a hidden copy of the whole unsharded buffer, which
    counts against the peak while the collective is in flight:

    * ``reduce_scatter_tensor`` *is* an all_reduce: ProcessGroupGloo clones the input, all-reduces the
      clone and copies this rank's chunk out at ``wait()``. The group's packed gradient buffer is its
      own, so it is all-reduced in place instead: the same sums, without the clone and the separate
      output.
    * ``all_gather_into_tensor`` gathers into a new flat tensor of the output's size in gloo's worker
      thread, then copies it into the output. With prefetch that copy is alive while the current
      group computes (FSDP2 on CPU gathers synchronously, so its copy lives only during the call). The
      gather runs as one in-place broadcast per rank into its own chunk of the output instead: each
      rank sends the same bytes ((k - 1) x its shard) and nothing but the output is allocated.
    """
    if inp.device.type != "cpu":
        return False
    try:
        be = str(dist.get_backend(group.handle))
    except (RuntimeError, ValueError):
        return False
    return be == "gloo" or "cpu:gloo" in be


class _BroadcastGather:
    """The all_gather of ``group_size`` chunks of ``rows`` elements into ``out`` as ``group_size`` in-place broadcasts
    (gloo, see :func:`gloo_cpu`); ``wait()`` waits for all of them, like one collective's work handle."""

    def __init__(self, out, rows, group_size, handle):
        self._works = [dist.broadcast(out[r * rows: (r + 1) * rows], group_src=r, group=handle, async_op=True)
                       for r in range(group_size)]

    def wait(self):
        for w in self._works:
            w.wait()
        return True


class FSDPParamGroup:
    def __init__(self, fsdp_params):
        self.params = fsdp_params
        p0 = fsdp_params[0]
        self.shard_group, self.rep_group = p0.shard_group, p0.rep_group
        self.k = self.shard_group.size
        self.offsets = []
        off = 0
        for p in fsdp_params:
            self.offsets.append(off)
            off += p.padded
        self.S = off
        dtypes = {p.param_dtype for p in fsdp_params}
        if len(dtypes) != 1:
            raise ValueError(f"fully_shard: the parameters of one group must share one dtype to be gathered in one "
                             f"flat buffer, got {sorted(map(str, dtypes))} ({[p.fqn for p in fsdp_params]})")
        self.ag_dtype = dtypes.pop()
        rdt = {p.reduce_dtype for p in fsdp_params}
        self.rs_dtype = rdt.pop() if len(rdt) == 1 else torch.float32
        self.state = SHARDED
        self._ag = None
        self._ag_rank = None
        self._rs = None
        self._rs_full = False  # the reduction in flight is an in-place all_reduce of the packed input (gloo)
        self._rs_input = None
        self._gloo_in_place = None
        self.divide_factor = None
        self.requires_all_reduce = True
        self.all_reduce_hook = None  # FSDPModule.set_all_reduce_hook (torchft's replicate dim): see _run_hook
        self.force_sum = False  # FSDPModule.set_force_sum_reduction_for_comms: the hook sees sums
        self._hooks_installed = False
        self.expected = None
        self.on_all_grads = None
        # hsdp modes: "all_reduce" keeps the full averaged gradient on every rank (HyperParallel level1,
        # ZeRO-1); persistent keeps the unsharded parameters for good (ZeRO-1/2): the shards are views
        # of them and the only all_gather is the one after an optimizer step changed the shards
        self.grad_reduce = "reduce_scatter"
        self.persistent = False
        self._gathered_versions = None

    def make_persistent(self):
        """ZeRO-1/2: unsharded parameters allocated now and kept; each shard becomes a view of its rows."""
        self.persistent = True
        for p in self.params:
            if p.dim != 0:
                raise ValueError(f"hsdp ZeRO modes shard dim 0 only (parameter {p.fqn!r} asks for dim {p.dim})")
            p.make_shard_a_view()
        self._install_grad_hooks()
        self.state = UNSHARDED
        self._gathered_versions = self._versions()

    def _versions(self):
        return tuple(p.local_shard()._version for p in self.params)

    @property
    def device(self):
        """Where the shards live now (follows ``module.to_empty(device=...)`` after meta init)."""
        p0 = self.params[0]
        if p0.compute_device is not None:  # CPU offload: gather and compute on the accelerator
            return p0.compute_device
        p0.refresh_sharded()
        return p0.local_shard().device

    # ------------------------------------------------------------------ all_gather
    def unshard(self, async_op: bool = True):
        """Issue the group's flat all_gather (no-op when already unsharded or in flight)."""
        if self.state == UNSHARDED and self._versions() != self._gathered_versions:
            # the shards changed while the unsharded parameters were kept (an optimizer step after
            # set_reshard_after_backward(False), or the ZeRO modes): gather them again
            self.state = SHARDED
        if self.state != SHARDED:
            return
        with torch.no_grad():
            self._issue_all_gather()
        if not async_op:
            self.wait_for_unshard()

    def _issue_all_gather(self):
        for p in self.params:
            p.refresh_sharded()
        if self.k == 1:
            send = torch.empty(self.S, dtype=self.ag_dtype, device=self.device)
            self._copy_in(send)
            self._ag = (None, send)
        else:
            # in place, as FSDP2 does: this rank's input is its own chunk of the output, so no separate
            # send buffer (one shard of the group) is alive while the gather is in flight (prefetch)
            out = torch.empty(self.k * self.S, dtype=self.ag_dtype, device=self.device)
            me = self._group_rank()
            send = out[me * self.S: (me + 1) * self.S]
            self._copy_in(send)
            rec.record(rec.ALL_GATHER, self.S * send.element_size(), self.shard_group.ranks)
            if _CHECK[0]:
                _fault.check(_AG, self.shard_group, send)
            if self._gloo_in_place is None:  # asked once per group (the backend does not change)
                self._gloo_in_place = gloo_cpu(self.shard_group, out)
            try:
                if self._gloo_in_place:
                    work = _BroadcastGather(out, self.S, self.k, self.shard_group.handle)
                else:
                    work = _all_gather_single(out, send, group=self.shard_group.handle, async_op=True)
            except RuntimeError as exc:
                _fault.fail(_AG, self.shard_group, exc)
            self._ag = (work, out)
        self.state = UNSHARDING

    def _copy_in(self, send):
        for p, off in zip(self.params, self.offsets):
            p.copy_in(send[off: off + p.padded])

    def _group_rank(self) -> int:
        """This process's index in the all_gather output (the process group's rank order)."""
        if self._ag_rank is None:
            self._ag_rank = dist.get_rank(group=self.shard_group.handle)
        return self._ag_rank

    def wait_for_unshard(self):
        """Finish the all_gather (issuing it first if needed) and expose the unsharded parameters."""
        self.unshard()
        if self.state == UNSHARDING:
            work, out, *send = self._ag
            self._ag = None
            with torch.no_grad():
                if work is not None:
                    _fault.wait(work, _AG, self.shard_group)
            gathered = out.view(self.k, self.S)
            for p, off in zip(self.params, self.offsets):
                p.alloc_unsharded(self.device)
                p.copy_out(gathered[:, off: off + p.padded], self.k)
            del gathered
            _free_now(out, *send)
            self._install_grad_hooks()
            self.state = UNSHARDED
            self._gathered_versions = self._versions()
        for p in self.params:
            p.to_unsharded()

    def reshard(self):
        if self.state == UNSHARDING:  # an all_gather cannot be cancelled: finish it, then free
            with torch.no_grad():
                self._ag[0] is not None and _fault.wait(self._ag[0], _AG, self.shard_group)
            _free_now(*self._ag[1:])
            self._ag = None
            if self.persistent:
                self.state = UNSHARDED
        for p in self.params:
            p.refresh_sharded()  # the module may hold a replaced sharded parameter (to_empty)
            if not self.persistent:
                p.free_unsharded()
            p.to_sharded()
        if not self.persistent:
            self.state = SHARDED

    # ------------------------------------------------------------------ post-backward tracking
    def _install_grad_hooks(self):
        for p in self.params:
            if getattr(p, "_new_unsharded", False):
                p._new_unsharded = False
                if p.requires_grad:
                    p.unsharded.register_post_accumulate_grad_hook(lambda t, p=p: self._grad_ready(p))

    def expect_grads(self):
        """At this group's pre-backward: which unsharded parameters will the running backward accumulate into."""
        exp = set()
        for p in self.params:
            u = p.unsharded
            if u is None or not u.requires_grad:
                continue
            with torch.enable_grad():
                node = u.view_as(u).grad_fn.next_functions[0][0]
            try:
                will = bool(torch._C._will_engine_execute_node(node))
            except RuntimeError:
                will = False
            if will:
                exp.add(id(p))
        self.expected = exp
        return bool(exp)

    def _grad_ready(self, param):
        exp = self.expected
        if exp is None or id(param) not in exp:
            return
        exp.discard(id(param))
        if not exp:
            self.expected = None
            if self.on_all_grads is not None:
                self.on_all_grads()

    # ------------------------------------------------------------------ reduce_scatter
    def reduction_pending(self) -> bool:
        """A reduction was issued and its result is not yet in the sharded gradients."""
        return self._rs is not None

    def reduce_grads(self):
        """Issue one reduce_scatter of the flat unsharded gradients; free the unsharded gradients."""
        if self._rs is not None:  # one left in flight by a backward that was not the last: land it first
            with torch.no_grad():
                self.finish_reduce()
        have = [p.unsharded is not None and p.unsharded.grad is not None for p in self.params]
        if not any(have):
            return
        if self.grad_reduce == "all_reduce":
            return self._all_reduce_grads(have)
        k = self.k
        blocks = []
        for p, h in zip(self.params, have):
            if h:
                blocks.append(p.grad_rows(p.unsharded.grad, k, self.rs_dtype))
                p.unsharded.grad = None
            else:
                blocks.append(torch.zeros(k, p.padded, dtype=self.rs_dtype, device=self.device))
        inp = torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0].contiguous()
        del blocks  # views of the unsharded gradients: free those before the collective (gloo copies its input)
        if k == 1:
            self._rs = (None, inp.view(-1), have)
            return
        rec.record(rec.REDUCE_SCATTER, inp.numel() * inp.element_size(), self.shard_group.ranks)
        if _CHECK[0]:
            _fault.check(_RS, self.shard_group, inp)
        if self._gloo_in_place is None:  # asked once per group (the backend does not change)
            self._gloo_in_place = gloo_cpu(self.shard_group, inp)
        in_place = self._gloo_in_place
        out = inp if in_place else torch.empty(self.S, dtype=self.rs_dtype, device=self.device)
        try:
            if in_place:
                work = dist.all_reduce(inp.view(-1), op=dist.ReduceOp.SUM, group=self.shard_group.handle,
                                       async_op=True)
            else:
                work = _reduce_scatter_single(out, inp.view(-1), op=dist.ReduceOp.SUM,
                                              group=self.shard_group.handle, async_op=True)
        except RuntimeError as exc:
            _fault.fail(_RS, self.shard_group, exc)
        self._rs = (work, out, have)
        self._rs_full = in_place
        self._rs_input = inp  # freed by this group once the reduction is done (see _free_now)

    def _land_reduce_scatter(self):
        """Wait for the group's reduce_scatter; ``self._rs`` becomes ``(None, out, have)``, ``out`` this rank's
        ``S`` reduced elements (after an in-place all_reduce: a copy of its rows, the packed input dropped)."""
        work, out, have = self._rs
        if work is not None:
            _fault.wait(work, _RS, self.shard_group)
        if self._rs_full:
            out = out.view(self.k, self.S)[self.shard_group.rank].clone()
            self._rs_full = False
        inp, self._rs_input = self._rs_input, None
        if inp is not None and inp.data_ptr() != out.data_ptr():
            _free_now(inp)
        self._rs = (None, out, have)

    def release_send_buffer(self):
        """Wait for the in-flight reduce_scatter and drop its flat input (the full-size packed gradients).

        The asynchronous work keeps its input alive until the handle is dropped; without this every
        group's packed input would live until the root's end-of-backward callback (one unsharded
        gradient per group at the peak). The next group's post-backward calls it before packing its
        own input, so at most one group's packed input is alive at a time, as in FSDP2.
        """
        if self._rs is None or len(self._rs) != 3 or (self._rs[0] is None and not self._rs_full):
            return
        self._land_reduce_scatter()

    def _all_reduce_grads(self, have):
        """One all_reduce of the flat full gradients (the shard group's; HSDP adds the replicate group's)."""
        pieces = []
        for p, h in zip(self.params, have):
            if h:
                pieces.append(p.unsharded.grad.reshape(-1).to(self.rs_dtype))
                p.unsharded.grad = None
            else:
                pieces.append(torch.zeros(p.unsharded.numel(), dtype=self.rs_dtype, device=self.device))
        flat = torch.cat(pieces)
        work = None
        if self.k > 1:
            rec.record(rec.ALL_REDUCE, flat.numel() * flat.element_size(), self.shard_group.ranks)
            if _CHECK[0]:
                _fault.check(_AR, self.shard_group, flat)
            try:
                work = dist.all_reduce(flat, group=self.shard_group.handle, async_op=True)
            except RuntimeError as exc:
                _fault.fail(_AR, self.shard_group, exc)
        self._rs = (work, flat, have, "all_reduce")

    def start_replica_reduce(self):
        """HSDP: once the reduce_scatter is done, issue the all_reduce over the replicate dim (async).

        The root calls this for every group before finishing any, so the replicate all_reduces of
        all groups are in flight together.
        """
        if self._rs is None or len(self._rs) == 4:
            return
        self._land_reduce_scatter()
        _, out, have = self._rs
        ar = None
        n = self.k
        if self.rep_group is not None and self.rep_group.size > 1 and self.requires_all_reduce:
            rec.record(rec.ALL_REDUCE, out.numel() * out.element_size(), self.rep_group.ranks)
            if _CHECK[0]:
                _fault.check(_RAR, self.rep_group, out)
            try:
                ar = dist.all_reduce(out, group=self.rep_group.handle, async_op=True)
            except RuntimeError as exc:
                _fault.fail(_RAR, self.rep_group, exc)
            n *= self.rep_group.size
        self._rs = (ar, out, have, n, "replica")

    def finish_reduce(self):
        """Wait for the reduce_scatter (and HSDP all_reduce), average, add to the sharded grads."""
        if self._rs is None:
            return
        if len(self._rs) == 4:
            return self._finish_all_reduce()
        if len(self._rs) == 3:
            self.start_replica_reduce()
        work, out, have, n, _ = self._rs
        self._rs = None
        if work is not None:
            _fault.wait(work, _RAR if self.rep_group is not None and self.rep_group.size > 1 else _RS,
                        self.rep_group if self.rep_group is not None and self.rep_group.size > 1 else self.shard_group)
        factor = self.divide_factor if self.divide_factor is not None else n
        self._divide_and_hook(out, factor)
        for p, off, h in zip(self.params, self.offsets, have):
            if h:
                p.accumulate_sharded_grad(out[off: off + p.padded])
        if self.k > 1:  # (with k == 1 it is the packed input, which may be a view of a gradient)
            _free_now(out)

    def _divide_and_hook(self, out, factor):
        """Average the reduced gradients and run the user's all-reduce hook on them, in FSDP2's order.

        torch 2.13 (``foreach_reduce``) reduces fp32/bf16 with ``AVG`` (or ``PREMUL_SUM(1/factor)``),
        so the hook sees the averaged reduce-scatter output (after the HSDP all_reduce, if any) and
        the gradient is assigned from whatever the hook left in place; with
        ``set_force_sum_reduction_for_comms(True)`` the collectives sum, the hook sees the sums and
        the division comes after it. torchft's hook all-reduces the tensor in place over the replica
        groups (``hyper_parallel/ft``).
        """
        hook = self.all_reduce_hook
        if hook is not None and self.force_sum:
            hook(out)
        if factor != 1:
            out.div_(factor)
        if hook is not None and not self.force_sum:
            hook(out)

    def _finish_all_reduce(self):
        work, flat, have, _ = self._rs
        self._rs = None
        if work is not None:
            _fault.wait(work, _AR, self.shard_group)
        n = self.k
        if self.rep_group is not None and self.rep_group.size > 1 and self.requires_all_reduce:
            rec.record(rec.ALL_REDUCE, flat.numel() * flat.element_size(), self.rep_group.ranks)
            if _CHECK[0]:
                _fault.check(_RAR, self.rep_group, flat)
            try:
                dist.all_reduce(flat, group=self.rep_group.handle)
            except RuntimeError as exc:
                _fault.fail(_RAR, self.rep_group, exc)
            n *= self.rep_group.size
        factor = self.divide_factor if self.divide_factor is not None else n
        self._divide_and_hook(flat, factor)
        off = 0
        for p, h in zip(self.params, have):
            numel = 1
            for s in p.full_shape:
                numel *= s
            if h:
                p.set_shard_grad_from_full(flat[off: off + numel].view(p.full_shape))
            off += numel
