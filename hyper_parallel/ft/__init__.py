"""Training that survives a lost replica group without a restart: torchft replica groups, healing, DiLoCo.

Design (one screen)
-------------------
* **torchft does the protocol.** A ``torchft_lighthouse`` decides the quorum of replica groups each
  step; each rank runs a ``torchft.Manager`` (``manager.py``) whose reconfigurable process group
  joins rank ``r`` of every group. Nothing here re-implements quorum, commit or transport.
* **HSDP with a fault-tolerant replicate dim** (``replicate.py``): FSDP (and TP) inside a group, and
  ``FSDPModule.set_all_reduce_hook`` averaging each reduced gradient shard over the live groups
  through the Manager (torchtitan's torchft path).
* **Commit only on agreement** (``optimizer.py``): torchft's ``OptimizerWrapper`` (quorum at
  ``zero_grad``, ``step`` only if ``should_commit``) plus a guard: a group never commits alone
  before it has stepped with a peer (no split brain after a restart).
* **Healing** (``state.py``): model, optimizer, RNG and data-position state as local shards plus
  layouts (torchft's ``PGTransport`` moves plain tensors; our DTensors are not torch DTensors); the
  layouts are checked when a group heals.
* **Semi-synchronous** (``semi_sync.py``): torchft's DiLoCo / LocalSGD over a storage-sharing local
  view of the model.
* ``lighthouse.py``: start the real lighthouse on a free port; reach it or fail fast.

Docs: ``docs/fault_tolerance.md`` ("Replica groups with torchft"). Example:
``examples/llama/train.py --ft-replica-group-id G --ft-lighthouse ADDR``; ``scripts/ft_demo.sh``.
"""
from hyper_parallel.ft.lighthouse import Lighthouse, check_reachable, majority
from hyper_parallel.ft.manager import make_manager
from hyper_parallel.ft.optimizer import FTOptimizer, SoloGuard, guard_solo_commits
from hyper_parallel.ft.replicate import CrossGroupBytes, count_cross_group_bytes, replicate_over_groups
from hyper_parallel.ft.semi_sync import local_view, semi_sync
from hyper_parallel.ft.state import (check_same_model, model_fingerprint, load_model_state, load_optimizer_state, load_rng_state, model_state,
                                     optimizer_state, register_healing, rng_state, state_digest)

__all__ = ["Lighthouse", "check_reachable", "majority", "make_manager", "FTOptimizer", "SoloGuard",
           "guard_solo_commits", "CrossGroupBytes",
           "count_cross_group_bytes", "replicate_over_groups", "local_view", "semi_sync", "register_healing",
           "model_state", "load_model_state", "optimizer_state", "load_optimizer_state", "rng_state",
           "load_rng_state", "state_digest", "check_same_model", "model_fingerprint"]
