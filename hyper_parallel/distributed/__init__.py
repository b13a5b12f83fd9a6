"""The ground floor: torch.distributed and autograd, adapted once for everything above.

Design (one screen)
-------------------
* **Why a floor.** Every parallelism moves tensors between ranks. The ways it can go wrong (a dead
  peer, a hang, two ranks that disagree about the next collective) are the same everywhere, so they
  are handled once, here, and every package above calls these functions instead of
  ``torch.distributed`` directly. Megatron's ``mappings.py`` is the model: each collective is named
  where it runs.
* **Files.**
  ``groups.py``: the default group's start, one cached ``CommGroup`` (``comm_group.py``) per rank set,
  adoption of a torch ``DeviceMesh``'s groups. ``collectives.py``: plain collectives on local tensors
  (uneven sizes through ``uneven_padding.py``; under ``torch.compile`` the traceable ones of
  ``traced_collectives.py``). ``differentiable.py``: one autograd Function per collective, each
  backward the exact adjoint. ``p2p.py``: batched point-to-point exchanges (cross-mesh moves, pipeline
  boundaries). ``deferred_grads.py``: gradient reductions batched into one flat all_reduce per
  backward. ``partial_grad_graph.py``: the autograd-graph walk that lets a ``Partial`` gradient seed
  flow unreduced. ``collective_errors.py`` / ``collective_guard.py``: ``CollectiveError`` naming the
  collective, group, mesh dim and peer; the one collective timeout; the opt-in desync check.
  ``comm_record.py``: the byte model and the records ``CommDebugMode`` reads; ``comm_keys.py``:
  torch's own collective functions mapped to those kinds. ``launch.py``: process-group start and
  teardown that survive torchrun restarts. ``rng.py``: seeded random blocks.
* **Imports.** torch only; nothing of the library above (the ``ground-floor`` import contract).
* **Where a change goes.** A new collective or a fix to one: ``collectives.py`` and, with its
  adjoint, ``differentiable.py``. A new failure mode: ``collective_guard.py``.
"""
