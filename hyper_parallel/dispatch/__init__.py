"""The op path: what runs when an op meets a DTensor, and the sharding rules it asks.

Design (one screen)
-------------------
* **One dispatcher object.** ``DTensor.__torch_function__`` (defined once, in ``dtensor/dtensor.py``)
  calls ``dispatcher.ENTRY.torch_function``. In eager mode that is the fast path (a cache keyed
  by the op and the interned layout of each argument, a hit runs the op on local tensors and wraps
  the result in a few microseconds) falling back to the rule-based path; in compile mode (the first
  time dynamo meets a DTensor) each op becomes one opaque node (``compile/compile_mode.py``).
* **Files.** ``dispatcher.py``: the dispatcher, its caches, redistribution of inputs, partial-gradient
  views, wrapping. ``call_args.py``: argument collection and cache signatures (the
  Python-level ``__add__``/``view``/... that skip the C++ entry on a cache hit are part of the class:
  ``dtensor/fast_path.py``, reading the fast cache this package fills). ``modes.py``: the
  switches (strict layouts, replicate fallback, debug). ``strict_layouts.py``: the strict-layout
  verdict and HyperParallel's error messages. ``rules/``: one file per op family, each registering
  ``DistributedOp`` rules (``rules/base.py``: the registry, ``register``/``override``).
  ``dfunction.py`` (``DFunction``), ``local_map.py``. (HyperParallel's ``shard_module`` /
  ``ShardingPlan`` live in ``compat/hyperparallel/``.)
* **Imports.** The ground floor, ``compile``, ``dtensor``; nothing above.
* **Where a change goes.** A new op: a rule in the family's file under ``rules/``. A new switch:
  ``modes.py``. A change to every op's cost: ``dispatcher.py`` (benchmark with bench_dispatch.py).
"""
from hyper_parallel.dispatch import dispatcher  # noqa: F401  (installs the DTensor op handler)
from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy, OpCall
from hyper_parallel.dispatch.rules.op_table import load_all as _load_all

_load_all()
from hyper_parallel.dispatch.dfunction import DFunction
from hyper_parallel.dtensor.skip_and_replication import SkipDTensorDispatch
from hyper_parallel.dispatch.local_map import local_map, custom_shard
