"""Context parallelism: the sequence of every activation sharded over a ``cp`` mesh; exact attention.

Design (one screen)
-------------------
* **Layout first.** ``plan.py`` says which global positions each cp rank holds: one contiguous
  segment, or head-tail chunks ``r`` and ``2cp-1-r`` (``load_balance=True``, equal causal work).
  Lengths not divisible by ``2 * cp`` give shards differing by one position; there is no padding,
  so nothing leaks into the user's tensors or loss. ``cp_shard`` / ``cp_unshard`` apply a layout to
  inputs, labels, position ids and rotary tables, and undo it.
* **The order is explicit.** Every shard helper records the order of the shards it made for its cp
  group (``order.py``: a ``SequenceOrder``, the reorder indices): ``cp_shard``'s layouts, and torch's
  ``_context_parallel_shard`` with any load balancer (head-tail, per-document, PTRR, none; mirrored
  in ``torch_private.py`` / ``load_balancer.py``). The attention plans on the recorded order and checks
  it against its inputs; an unknown or unfitting order raises.
* **One kernel, three methods.** Attention is a ring over K/V blocks with online-softmax (log-sum-
  exp) merging of per-block ``(out, lse)``; the per-block kernel is explicit math on local tensors,
  so any device and dtype (CPU, float64) works. ``"ring"``: the ring is the cp mesh. ``"ulysses"``:
  an all_to_all trades the sequence shard for a head shard (uneven head counts allowed, GQA K/V
  heads repeated up to the cp degree), a one-rank "ring" runs locally, an all_to_all trades back.
  ``"hybrid"``: Ulysses over mesh dim 0, ring over mesh dim 1 (positions of a ring rank = the
  union of its Ulysses group's shards).
* **Masks are position rules.** ``masks.py`` classifies every (query segment, K/V segment) block as
  empty (skipped, never computed), full (no mask) or partial (dense mask built from global
  positions): causal, none, sliding window, documents (``cu_seqlens`` / doc ids). Anything else
  raises.
* **Exact backward without recomputing attention.** The ring's autograd Function keeps only
  local q, k, v, out, lse; backward recomputes block scores and sends each block's dK/dV around the
  ring back to its owner (or reduce-scatters them after an all_gather rotation).
* **APIs users know.** ``ContextParallel(method=..., load_balance=...)`` is a ``ParallelStyle`` whose
  module's ``F.scaled_dot_product_attention`` calls become context-parallel (parameters untouched);
  ``hyper_parallel.experimental.context_parallel`` is torch 2.13's context manager, exact on CPU.
  ``context_parallel_attention`` (and ``ring_/ulysses_/hybrid_attention``) is the function on
  local tensors or on sequence-sharded DTensors.
* **Files.** ``plan.py``/``masks.py``: which positions each rank holds and which blocks are computed
  (no torch); ``api.py``: the attention entry points; ``ring.py``/``kernels.py``: the ring autograd
  Function and block kernels; ``sdpa_interception.py``: every route by which an SDPA call becomes
  context-parallel (function mode, the ``torch.compile`` custom op, the DTensor rule);
  ``torch_mechanics.py``: the torch operations the plan runs on.
  Imports: the ground floor, ``dtensor``, ``dispatch`` and the ``ParallelStyle`` base class.

Communication per layer forward, per rank (``b`` = bytes of this rank's K+V shard, ``q``/``o`` its
query/output shard; formulas and checks in ``comm.py`` and ``docs/context_parallel.md``): ring p2p
``(cp-1) * b`` in ``cp-1`` sends; ring all_gather ``(cp-1) * b`` in one all_gather; Ulysses 4
all_to_alls of ``(cp-1)/cp * (q + b + o)`` bytes in all.
"""
from hyper_parallel.context_parallel.api import (context_parallel_attention, hybrid_attention, options, ring_attention,
                                                 ulysses_attention)
from hyper_parallel.context_parallel.sdpa_interception import attention_mask
from hyper_parallel.context_parallel.shard import cp_shard, cp_unshard
from hyper_parallel.context_parallel.masks import CausalMask, DocumentMask, Mask, NoMask, SlidingWindowMask
from hyper_parallel.context_parallel.plan import shard_layout
from hyper_parallel.context_parallel.style import ContextParallel
from hyper_parallel.context_parallel.order import SequenceOrder
from hyper_parallel.context_parallel.positions import hook_position_ids, rank_positions
from hyper_parallel.context_parallel.torch_private import recorded_order

__all__ = [
    "ContextParallel", "cp_shard", "cp_unshard", "context_parallel_attention", "ring_attention",
    "ulysses_attention", "hybrid_attention", "attention_mask", "Mask", "NoMask", "CausalMask",
    "SlidingWindowMask", "DocumentMask", "shard_layout", "options", "SequenceOrder", "recorded_order",
    "rank_positions", "hook_position_ids",
]
