"""HyperParallel's module path ``hyper_parallel.core.shard._op_dispatch``: its dispatch switches.

HyperParallel programs import its dispatch switches from there (``add_no_skip_ops``,
``remove_no_skip_ops``, ``get_no_skip_ops``, ``disable_dtensor_dispatch``,
``enable_dtensor_dispatch``, ``get_dtensor_dispatch``) and name its ``OpDispatcher`` and the module's
instance ``_OP_DISPATCHER``. The switches live in :mod:`hyper_parallel.dispatch.modes`, the dispatcher
in :mod:`hyper_parallel.dispatch.dispatcher`; the names below are the same objects. This project's own
private names are not re-exported.
"""
from hyper_parallel.dispatch.dispatcher import OpDispatcher
from hyper_parallel.dispatch.dispatcher import _RULE_DISPATCHER as _OP_DISPATCHER  # noqa: F401  (HyperParallel's name)
from hyper_parallel.dispatch.modes import (add_no_skip_ops, disable_dtensor_dispatch, enable_dtensor_dispatch,
                                           get_dtensor_dispatch, get_no_skip_ops, remove_no_skip_ops)

__all__ = ["OpDispatcher", "add_no_skip_ops", "disable_dtensor_dispatch", "enable_dtensor_dispatch",
           "get_dtensor_dispatch", "get_no_skip_ops", "remove_no_skip_ops"]
