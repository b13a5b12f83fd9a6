"""Expert parallelism (EP) for mixture-of-experts models: torchtitan's styles on hyper_parallel's DTensor.

Design (one screen)
-------------------
* **Experts are grouped 3-D weights** (``w1``/``w3`` ``[E, hidden, dim]``, ``w2`` ``[E, dim, hidden]``),
  sharded ``Shard(0)`` over a 1-D EP mesh: EP rank ``r`` holds experts ``[r*E/ep, (r+1)*E/ep)``.
  ``E`` must be divisible by the EP degree.
* **Tokens are data-parallel across the EP ranks**: each rank routes its own tokens. The EP mesh
  is a view of data-parallel mesh dims (``mesh["ep"]`` of ``("dp", "ep")``, or ``dp_shard`` x ``cp``); a
  mesh dim named ``tp`` or ``pp`` is refused.
* **Dispatch** = count exchange (one small all_to_all of per-expert counts that also carries every
  rank's input checks) + one host read of the counts (the only host sync) + one token all_to_all
  with variable splits + a gather regrouping the received rows expert-major. **Combine** is the
  inverse (gather, all_to_all), then the top-k outputs are summed with the routing weights.
  Backward of each all_to_all is the inverse all_to_all: 2 token all_to_alls forward, 2 backward,
  each moving ``tokens * top_k * hidden * itemsize`` bytes per rank (dropless).
* **Capacity** (optional): expert ``e`` keeps its first ``ceil(f * T_group * top_k / E)`` assignments
  in global token order (EP rank, then token); the count exchange is then an all_gather so every
  rank applies the rule alike (:func:`plan.kept_counts`). Dropless is the default.
* **Styles** (``parallelize_module(experts, ep_mesh, ExpertParallel())``): torchtitan's contract;
  the wrapped forward sees its local experts' rows and ``num_tokens_per_expert`` of length E/ep.
  ``ExpertTensorParallel`` adds tp inside each expert on a 2-D ``("ep", "tp")`` mesh.
* **Grouped matmul**: ``grouped_mm`` (``torch._grouped_mm`` where torch runs it, an exact loop
  elsewhere) and a ``_grouped_mm`` sharding rule for DTensors (``dispatch/rules/grouped_mm.py``).
* **Routing and balancing**: ``route_topk`` (softmax/sigmoid top-k, bias for selection only,
  DeepSeek-V3 group-limited), ``tokens_per_expert`` (one small all_reduce), ``update_expert_bias`` (DeepSeek-V3
  aux-loss-free), ``load_balance_loss``, ``load_metrics``.
* **Files.** ``plan.py``: input checks, split math and the capacity rule (no torch); ``comm.py``: the
  count exchange and the variable-split all_to_all; ``token_exchange.py``: dispatch/combine (tokens to and
  from their experts' ranks; named so that a file called "dispatch" always means op dispatch); ``style.py``: the
  EP styles; ``grouped_mm.py``, ``routing.py``, ``balance.py``. Imports: the ground floor
  (``hyper_parallel.distributed``), ``dtensor``, ``dispatch`` and the ``ParallelStyle`` base class.

Docs: ``docs/expert_parallel.md``.
"""
from hyper_parallel.moe import plan
from hyper_parallel.moe.plan import capacity, kept_counts
from hyper_parallel.moe.style import ExpertParallel, ExpertTensorParallel
from hyper_parallel.moe.token_exchange import DispatchHandle, combine, count_ids, dispatch
from hyper_parallel.moe.grouped_mm import grouped_mm
from hyper_parallel.moe.balance import load_balance_loss, load_metrics, tokens_per_expert, update_expert_bias
from hyper_parallel.moe.comm import STATS, reset_stats
from hyper_parallel.moe.routing import route_topk

__all__ = ["ExpertParallel", "ExpertTensorParallel", "DispatchHandle", "dispatch", "combine", "count_ids", "grouped_mm",
           "route_topk", "tokens_per_expert", "update_expert_bias", "load_balance_loss", "load_metrics", "STATS",
           "reset_stats", "capacity", "kept_counts", "plan"]
