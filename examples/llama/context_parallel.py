"""Context parallelism for the example Llama (``train.py --cp N --cp-method {ring,ulysses,hybrid}``).

The mesh gets cp dim(s) between the data-parallel dims and ``tp`` (torchtitan's order):
``("dp", ["dp_shard"], "cp", "tp")``, or ``("cp_ulysses", "cp_ring")`` in place of ``"cp"`` for
``--cp-method hybrid`` (``--cp 4`` -> (2, 2); see :func:`cp_mesh_shape`). Then:

* :func:`apply_context_parallel`: ``ContextParallel(method)`` on every block's attention over the cp
  dim(s); heads stay sharded by ``tp`` (the attention sees its local heads), the sequence by cp.
* Parameters stay replicated over cp; the data-parallel gradient reduction covers cp: FSDP shards
  over the flattened ``(dp_shard, cp...)`` dims, ``replicate`` averages over the flattened
  ``(dp, cp...)`` dims (:func:`dp_mesh_with_cp`).
* :class:`CPInputs`: tokens, labels and the rotary tables (the model's position encoding) are cut
  the same way by ``cp_shard(..., load_balance=True)`` (head-tail chunks: equal causal work).
* :meth:`CPInputs.loss_fn`: each rank's loss is ``cp * sum(local CE) / N`` (``N`` = this data-parallel
  rank's tokens over the whole sequence); the mean over the cp ranks is then the unsharded mean
  loss, and the gradient average over ``(dp, cp)`` is the gradient of the global mean loss, exact
  even when the shards differ by a position (it is the local mean when they are equal, as in
  torchtitan).
"""
from __future__ import annotations

from typing import Optional, Tuple

from hyper_parallel import parallelize_module
from hyper_parallel.context_parallel import ContextParallel, cp_shard

CP_1D = ("cp",)
CP_2D = ("cp_ulysses", "cp_ring")
METHODS = ("ring", "ulysses", "hybrid")


def cp_mesh_shape(cp: int, method: str) -> Tuple[int, ...]:
    """``(cp,)`` for ring/Ulysses; ``(U, R)`` for hybrid with ``U`` the largest divisor of cp with
    ``U * U <= cp`` (4 -> (2, 2), 8 -> (2, 4), 2 -> (1, 2))."""
    if method not in METHODS:
        raise ValueError(f"--cp-method must be one of {METHODS}, got {method!r}")
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"--cp must be a positive integer, got {cp!r}")
    if method != "hybrid":
        return (cp,)
    u = max(d for d in range(1, cp + 1) if cp % d == 0 and d * d <= cp)
    return (u, cp // u)


def cp_dim_names(method: str) -> Tuple[str, ...]:
    return CP_2D if method == "hybrid" else CP_1D


def cp_dims(mesh) -> Tuple[str, ...]:
    """The cp dim names present in ``mesh`` (empty without context parallelism)."""
    names = mesh.mesh_dim_names or ()
    return tuple(n for n in CP_1D + CP_2D if n in names)


def cp_mesh(mesh):
    """The cp (sub)mesh of ``mesh`` (1-D, or 2-D ``(cp_ulysses, cp_ring)``), or ``None``."""
    dims = cp_dims(mesh)
    return mesh[dims] if dims else None


def cp_size(mesh) -> int:
    sub = cp_mesh(mesh)
    return sub.size() if sub is not None else 1


def dp_mesh_with_cp(mesh, dp_dim: str):
    """The data-parallel mesh whose gradient reduction also covers cp: ``mesh[dp_dim]`` without cp,
    else ``mesh[dp_dim, *cp]`` flattened (collective: every rank calls it)."""
    dims = cp_dims(mesh)
    if not dims:
        return mesh[dp_dim]
    names = (dp_dim,) + dims
    return mesh[names]._flatten("_".join(names))


def apply_context_parallel(model, mesh, method: str = "ring", load_balance: bool = True):
    """``ContextParallel(method)`` on every block's attention over the cp dim(s) of ``mesh`` (no-op without)."""
    sub = cp_mesh(mesh)
    if sub is None:
        return model
    expect = CP_2D if method == "hybrid" else CP_1D
    if cp_dims(mesh) != expect:
        raise ValueError(f"--cp-method {method!r} needs the cp mesh dims {expect}, the mesh has {cp_dims(mesh)}")
    parallelize_module(model, sub, {"layers.*.attention": ContextParallel(method=method, load_balance=load_balance)})
    return model


class CPInputs:
    """Shards of the model's inputs for this cp rank: call once after parallelizing (rotary tables),
    then :meth:`shard` on every batch and use :meth:`loss_fn` as the loss."""

    def __init__(self, model, mesh, seq_len: int, load_balance: bool = True):
        self.mesh = cp_mesh(mesh)
        self.cp = self.mesh.size() if self.mesh is not None else 1
        self.seq_len = seq_len
        self.load_balance = load_balance
        if self.mesh is None:
            return
        if seq_len < self.cp:
            raise ValueError(f"seq_len {seq_len} must be >= the cp degree {self.cp}")
        if model.rope_cos.shape[0] < seq_len:
            raise ValueError(f"seq_len {seq_len} > the model's max_seq_len {model.rope_cos.shape[0]}")
        # the rotary tables of this rank's positions (the model slices rope_cos[:local_len])
        model.rope_cos, model.rope_sin = cp_shard(self.mesh, [model.rope_cos[:seq_len], model.rope_sin[:seq_len]],
                                                  [0, 0], load_balance=load_balance)

    def shard(self, tokens, labels):
        """This rank's head-tail shards of ``tokens`` and ``labels`` [B, S] (unchanged without cp)."""
        if self.mesh is None:
            return tokens, labels
        if tokens.shape[1] != self.seq_len:
            raise ValueError(f"batch sequence length {tokens.shape[1]} != the seq_len {self.seq_len} the rotary "
                             f"tables were sharded for")
        tok, lab = cp_shard(self.mesh, [tokens, labels], [1, 1], load_balance=self.load_balance)
        return tok, lab

    def loss_fn(self, base):
        """``base(logits, targets)`` (a mean over the local tokens) rescaled to ``cp * local sum / N``."""
        if self.mesh is None:
            return base
        cp, S = self.cp, self.seq_len

        def loss(logits, targets):
            n_local = targets.numel()
            n_global = targets.shape[0] * S
            return base(logits, targets) * (cp * n_local / n_global)
        return loss


def describe(method: Optional[str], mesh) -> str:
    sub = cp_mesh(mesh)
    if sub is None:
        return ""
    shape = "x".join(str(s) for s in sub.shape)
    return f" cp={sub.size()}({method}{', ' + shape if sub.ndim == 2 else ''})"


def compile_blocks_cp(model, backend="inductor", whole=True):
    """``--compile`` with ``--cp``: ``torch.compile`` each whole transformer block (``fullgraph=True``,
    ``dynamic=False``, no graph breaks), its context-parallel attention included: while compiling, the
    intercepted ``F.scaled_dot_product_attention`` becomes one opaque op (``hyper_parallel_cp::sdpa``,
    ``hyper_parallel/context_parallel/sdpa_interception.py``), so dynamo never traces the mesh
    planning or the ring's point-to-point sends. (Under compile the ``attention_mask(...)`` context is
    not supported; ``is_causal`` is.)

    ``whole=False``: the previous path, each block's ``feed_forward``, ``attention_norm`` and ``ffn_norm``
    compiled and the attention eager."""
    import torch
    for name, block in list(model.layers.items()):
        if whole:
            model.layers.register_module(name, torch.compile(block, backend=backend, fullgraph=True,
                                                             dynamic=False))
            continue
        for part in ("attention_norm", "feed_forward", "ffn_norm"):
            block.register_module(part, torch.compile(getattr(block, part), backend=backend, fullgraph=True,
                                                      dynamic=False))
    return model
