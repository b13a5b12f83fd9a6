"""One parameter under ``fully_shard``: its sharded DTensor, its unsharded tensor, and the flat-buffer geometry.

Why this shape:

* The *sharded* parameter is the one the optimizer, ``state_dict()`` and
  ``clip_grad_norm_`` see: a DTensor on the root mesh whose layout is the
  parameter's TP layout (if any) with the dp shard added innermost on the shard
  dim (``torch.chunk`` of the TP-local tensor), replicated over an HSDP
  replicate dim. Its local tensor holds exactly this rank's rows, unpadded.
* The *unsharded* parameter is a plain leaf tensor of the TP-local (or full)
  shape, created once and kept for the module's lifetime. Resharding frees its
  storage (``untyped_storage().resize_(0)``) and unsharding re-allocates it and
  copies the all-gathered values in without bumping its version counter, so
  tensors saved for backward that alias it stay valid across a
  reshard-after-forward / re-gather-before-backward cycle (FSDP2 does the same).
  Gradients accumulate into its ``.grad`` (full size) and are reduce-scattered
  from there.
* Each parameter occupies ``padded`` elements of the group's flat per-rank
  buffer: ``ceil(n / k)`` rows of the shard dim (``k`` = shard-group size), so
  rank ``r``'s piece starts at ``r * S`` in the all-gathered buffer and the
  rows of every rank concatenate to the unsharded tensor.
"""
from __future__ import annotations

import torch
from torch import nn

from hyper_parallel.dtensor.dtensor import DTensor
from hyper_parallel.dtensor.layout import Layout, chunk_size_and_offset


def _root_base_layout(root):
    base = getattr(root, "_base_layout", None)
    if base is None:
        base = root._base_layout = Layout.from_device_mesh(root)
    return base


class FSDPParam:
    """A managed parameter (see the module docstring)."""

    def __init__(self, param, fqn: str, owners, dp_mesh, shard_dim: int, mp_policy,
                 offload_pin_memory=None):
        self.fqn = fqn
        self.owners = owners  # [(module, attribute name)] (several when tied inside the group)
        self.requires_grad = param.requires_grad
        self.orig_dtype = param.dtype
        self.param_dtype = mp_policy.param_dtype if mp_policy.param_dtype is not None else param.dtype
        self.reduce_dtype = mp_policy.reduce_dtype if mp_policy.reduce_dtype is not None else self.param_dtype
        self.spmd_view = getattr(param, "_hp_spmd_view", None)  # (full mesh, layout): see fsdp/spmd_mesh.py
        root = dp_mesh._root
        # (fqn, mesh and shard dim were checked by hyper_parallel.fsdp.api before any parameter changed)
        if isinstance(param, DTensor):
            tp_mesh = param.device_mesh
            self.tp_mesh, self.tp_layout = tp_mesh, param._layout
            full_local = param._local_tensor.detach()
            gshape = tuple(param.shape)
            tp_dim_map = [tuple(tp_mesh._root_dims[d] for d in dims) for dims in param._layout.dim_map]
        else:
            self.tp_mesh = self.tp_layout = None
            full_local = param.detach()
            gshape = tuple(param.shape)
            tp_dim_map = [()] * param.dim()
        d = shard_dim % full_local.dim()
        self.dim = d
        shard_root_dim = dp_mesh._root_dims[-1]
        self.shard_group = dp_mesh.get_comm_group(dp_mesh.ndim - 1)
        self.rep_group = dp_mesh.get_comm_group(0) if dp_mesh.ndim == 2 else None
        k = self.shard_group.size
        me = self.shard_group.rank
        self.full_shape = tuple(full_local.shape)  # the unsharded (TP-local) shape
        n = self.full_shape[d]
        self.rows = -(-n // k) if n else 0  # padded rows per rank
        inner = 1
        for i, s in enumerate(self.full_shape):
            if i != d:
                inner *= s
        self.inner = inner
        self.padded = self.rows * inner
        self.sizes = [chunk_size_and_offset(n, k, r)[0] for r in range(k)]
        size, start = chunk_size_and_offset(n, k, me)
        self.shard_numel = size * inner
        local = full_local.narrow(d, start, size).clone(memory_format=torch.contiguous_format)
        # CPUOffloadPolicy: shards (and so gradients and the optimizer step) live on the CPU; the
        # all_gather copies them to the compute device (a no-op on a CPU-only machine)
        self.compute_device = None
        if offload_pin_memory is not None:
            if local.device.type != "meta":
                # with its index (cuda:0, not cuda): alloc_unsharded compares devices, and an unindexed
                # one never equals a tensor's, which re-allocated the unsharded parameter at every
                # unshard and left the one saved for backward freed (seen on an H100)
                self.compute_device = (torch.empty(0, device=dp_mesh.device_type).device
                                       if dp_mesh.device_type != "cpu" else None)
                local = local.to("cpu")
                if offload_pin_memory and torch.cuda.is_available():
                    local = local.pin_memory()
        dim_map = list(tp_dim_map)
        dim_map[d] = tuple(dim_map[d]) + (shard_root_dim,)
        layout = _root_base_layout(root).with_dim_map(tuple(dim_map))
        self.layout, self.gshape, self.root_mesh = layout, gshape, root
        dt = DTensor._wrap(local, root, layout, gshape)
        self.sharded = nn.Parameter(dt, requires_grad=self.requires_grad)
        self._full_local_for_zero = full_local
        self.unsharded = None       # plain leaf tensor (created at first unshard)
        self.unsharded_view = None  # what the module holds while unsharded (the TP DTensor or the leaf itself)
        self.acc_hook_group = None

    # ------------------------------------------------------------------ registration
    def _set_on_owners(self, value):
        for mod, name in self.owners:
            mod._parameters[name] = value

    def to_sharded(self):
        self._set_on_owners(self.sharded)

    def to_unsharded(self):
        self._set_on_owners(self.unsharded_view)

    def refresh_sharded(self):
        """Adopt a sharded parameter the module replaced while sharded (``to_empty`` off the meta device,
        ``load_state_dict(assign=True)``): the module's current one is the truth."""
        mod, name = self.owners[0]
        cur = mod._parameters.get(name)
        if cur is not self.sharded and isinstance(cur, DTensor) and cur._layout == self.layout:
            self.sharded = cur
            self.to_sharded()

    # ------------------------------------------------------------------ storage
    def local_shard(self) -> torch.Tensor:
        return self.sharded._local_tensor

    def alloc_unsharded(self, device):
        """Make sure the unsharded tensor exists with storage (contents unspecified)."""
        u = self.unsharded
        if u is None or u.device != device:
            u = torch.empty(self.full_shape, dtype=self.param_dtype, device=device)
            u = nn.Parameter(u, requires_grad=self.requires_grad)
            self.unsharded = u
            if self.spmd_view is not None:  # fully_shard(dp_mesh_dims=): a DTensor on the full mesh
                # its gradient is partial over the dp dims (a batch-sharded input); the pieces are what
                # the reduce-scatter (and HSDP all_reduce) sums, as torch's FSDP2: no sum before it
                u._hp_grad_summed_over = frozenset(g.ranks for g in (self.shard_group, self.rep_group)
                                                   if g is not None)
                w = DTensor._wrap(u, self.spmd_view[0], self.spmd_view[1], self.gshape)
                w._is_param = True
                self.unsharded_view = w
            elif self.tp_mesh is not None:
                w = DTensor._wrap(u, self.tp_mesh, self.tp_layout, self.gshape)
                w._is_param = True
                self.unsharded_view = w
            else:
                self.unsharded_view = u
            self._new_unsharded = True
            return u
        st = u.untyped_storage()
        need = u.numel() * u.element_size()
        if st.size() != need:
            st.resize_(need)
        return u

    def free_unsharded(self):
        u = self.unsharded
        if u is not None and u.untyped_storage().size() != 0:
            u.untyped_storage().resize_(0)

    def is_unsharded_allocated(self) -> bool:
        u = self.unsharded
        return u is not None and u.untyped_storage().size() != 0

    # ------------------------------------------------------------------ flat buffer pieces
    def copy_in(self, flat_piece: torch.Tensor):
        """Write this rank's shard (padded) into ``flat_piece`` (``padded`` elements)."""
        s = self.local_shard()
        if self.dim != 0:
            s = s.movedim(self.dim, 0)
        m = self.shard_numel
        if m:
            flat_piece[:m].view(s.shape).copy_(s, non_blocking=s.is_pinned())
        if m < self.padded:
            flat_piece[m:].zero_()

    def copy_out(self, gathered: torch.Tensor, group_size: int):
        """Fill the unsharded tensor from the (group_size, S) gathered view's columns of this parameter."""
        u = self.unsharded
        if self.dim == 0 and u.is_contiguous():
            # rank r's rows are row r of the (k, padded) view: copy them straight in (a reshape of the
            # strided column block would first copy the whole parameter into a temporary)
            full, per = u.numel(), self.padded
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(u):
                if full == group_size * per:
                    u.view(group_size, per).copy_(gathered)
                else:
                    flat = u.view(-1)
                    for r in range(group_size):
                        a, b = r * per, min(full, (r + 1) * per)
                        if b > a:
                            flat[a:b].copy_(gathered[r, : b - a])
            return
        moved = list(self.full_shape)
        moved.pop(self.dim)
        rows = gathered.reshape((group_size * self.rows, *moved))[: self.full_shape[self.dim]]
        if self.dim != 0:
            rows = rows.movedim(0, self.dim)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(u):
            u.copy_(rows)

    def grad_rows(self, grad: torch.Tensor, group_size: int, dtype) -> torch.Tensor:
        """The unsharded gradient as a (group_size, padded) block: rank r's rows padded to ``rows``."""
        if grad.dtype != dtype:
            grad = grad.to(dtype)
        if self.dim != 0:
            grad = grad.movedim(self.dim, 0)
        n = grad.shape[0]
        if n < group_size * self.rows:
            grad = torch.cat([grad, grad.new_zeros((group_size * self.rows - n,) + tuple(grad.shape[1:]))], dim=0)
        return grad.reshape(group_size, self.padded)

    def make_shard_a_view(self):
        """ZeRO modes: allocate the unsharded tensor now with the full values and make the sharded local
        tensor a view of this rank's rows (so the optimizer updates them in place)."""
        full_local = self._full_local_for_zero
        u = self.alloc_unsharded(full_local.device)
        with torch.no_grad():
            u.copy_(full_local.to(u.dtype))
        start = sum(self.sizes[: self.shard_group.rank])
        view = u.detach().narrow(0, start, self.sizes[self.shard_group.rank])
        dt = DTensor._wrap(view, self.root_mesh, self.layout, self.gshape)
        self.sharded = nn.Parameter(dt, requires_grad=self.requires_grad)
        self.to_sharded()
        self._full_local_for_zero = None

    def set_shard_grad_from_full(self, full_grad: torch.Tensor):
        """all_reduce modes: the sharded gradient is this rank's rows of the full (kept) gradient."""
        s = self.local_shard()
        start = sum(self.sizes[: self.shard_group.rank])
        g = full_grad.narrow(self.dim, start, s.shape[self.dim])
        if g.dtype != self.orig_dtype or g.device != s.device:
            g = g.to(dtype=self.orig_dtype, device=s.device)
        if s.grad is None:
            s.grad = g
        else:
            s.grad.add_(g)

    def accumulate_sharded_grad(self, flat_piece: torch.Tensor):
        """Add this rank's reduced gradient rows (from the flat output) to the sharded parameter's grad."""
        s = self.local_shard()
        shape = list(s.shape)
        if self.dim != 0:
            shape.insert(0, shape.pop(self.dim))
        g = flat_piece[: self.shard_numel].view(shape)
        if self.dim != 0:
            g = g.movedim(0, self.dim)
        if g.dtype != self.orig_dtype or g.device != s.device:
            g = g.to(dtype=self.orig_dtype, device=s.device).contiguous()
        else:  # never hand out views of the flat buffer
            g = g.clone(memory_format=torch.contiguous_format)
        if s.grad is None:
            s.grad = g
        else:
            s.grad.add_(g)
