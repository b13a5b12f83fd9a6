"""Auto-parallel planner: choose, check and apply the parallel layout of a model for a cluster.

Design (one screen)
-------------------
* **Read the model, don't template it.** ``plan()`` deep-copies the model to the meta device and traces
  one forward/backward (``model_stats.trace_model``: ``torch.utils.flop_counter`` FLOPs per module,
  ``saved_tensors_hooks`` for the bytes autograd keeps, the call order of Linears around
  ``scaled_dot_product_attention``). ``roles.infer_roles`` tags every parameter (embedding, attention
  q/k/v/o, MLP gate/up/down, norm, head, router, grouped experts) from the module tree and that trace;
  a module it cannot tag is an error naming it and the ``roles=`` override.
* **Cluster.** ``Cluster(world_size, devices_per_node, device_memory)`` with alpha-beta link speeds and a
  sustained FLOP/s; ``Cluster.preset("h100", ...)`` or ``Cluster.measure()`` on the launched world.
* **Exact state bytes, estimated activations.** ``memory`` reproduces the library's layouts (TP
  colwise/rowwise, FSDP ``torch.chunk`` shards, EP ``Shard(0)``), so parameter + gradient + AdamW bytes
  per rank are exact; activations come from the traced saved tensors scaled by tp/sp/cp/microbatches
  and activation checkpointing.
* **Cost model** (``cost.evaluate``): compute = FLOPs / throughput; per mesh dim the collectives each
  parallelism issues (FSDP all_gather/reduce_scatter with prefetch overlap, TP/SP per block, CP ring
  overlapped with attention or Ulysses all_to_all, EP dispatch/combine, PP p2p) in alpha-beta time;
  the pipeline bubble from the schedule's formula. Equations: ``docs/auto_parallel.md``.
* **Search** (``search.plan``): every (dp, fsdp, tp, pp, cp, ep) factorisation x SP x AC x schedule x
  microbatches x CP method (AC: none, per block, selective); invalid ones recorded with a reason (``explain_rejections()``); the rest
  scored, best first among those that fit.
* **Check and apply.** ``dry_run`` runs one real step of one rank under torch's fake process group
  (peak memory, collectives and pipeline messages with bytes; every pipeline stage role);
  ``Plan.apply(model)`` builds the mesh and applies the library's ``parallelize_module`` / CP /
  selective or full AC / EP / ``fully_shard``, and for pipelines the stages and torch's schedule
  (``apply.py``, ``pipeline.py``, ``selective_ac.py``; docs/auto_parallel.md "Apply").
  ``python -m hyper_parallel.auto --config demo --world 64`` prints the top plans.

This package uses only the library's public modules.
"""
from hyper_parallel.auto.cluster import Cluster, parse_bytes
from hyper_parallel.auto.plan import Memory, Plan, StepTime
from hyper_parallel.auto.search import evaluate_plan, explain_rejections, plan


def dry_run(plan, model_fn, *, world_size=None, rank=None, **kwargs):
    """See :func:`hyper_parallel.auto.dry_run.dry_run`."""
    from hyper_parallel.auto.dry_run import dry_run as _dry_run
    return _dry_run(plan, model_fn, world_size=world_size, rank=rank, **kwargs)


__all__ = ["Cluster", "Plan", "Memory", "StepTime", "plan", "dry_run", "explain_rejections", "evaluate_plan", "parse_bytes"]
