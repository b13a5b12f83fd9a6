"""Old home of the op dispatcher, kept as a thin re-export module.

HyperParallel code imports some of these names from here
(``add_no_skip_ops``, ``remove_no_skip_ops``, ``disable_dtensor_dispatch``...). The code
now lives in

* :mod:`hyper_parallel.dispatch.modes` - switches and flags (``implicit_replication``,
  ``allow_replicate_fallback``, ``set_debug``, strict layouts, SkipDTensorDispatch state);
* :mod:`hyper_parallel.dispatch.call_args` - argument walking;
* :mod:`hyper_parallel.dispatch.dispatcher` - ``__torch_function__``, the fast path and the
  rule-based dispatcher (``OpDispatcher``), caches.

The names below are the same objects (identity preserved). Module attributes of the
dispatcher that are *assigned* (e.g. ``_CACHE_MAX``) must be set on ``dispatcher``.
"""
from hyper_parallel.dispatch import dispatcher as _dispatcher
from hyper_parallel.dispatch.call_args import (  # noqa: F401
    _check_plain_tensors, _collect, _inplace_target, _op_name, _replace, _sig, _sig_nf)
from hyper_parallel.dispatch.dispatcher import (  # noqa: F401
    DERIVE_SHAPES, OpDispatcher, _CACHE, _FAST, _OP_DISPATCHER, _STATS, _handle, _run_local, _torch_function,
    cache_stats, clear_cache, dispatch, handle)
from hyper_parallel.dispatch.modes import (  # noqa: F401
    _debug_from_env, add_no_skip_ops, allow_replicate_fallback, disable_dtensor_dispatch, enable_dtensor_dispatch,
    get_no_skip_ops, implicit_replication, remove_no_skip_ops, set_debug, set_strict_layouts, strict_layouts)
from hyper_parallel.dtensor.dispatch_state import SKIP_ANY as _SKIP_ANY  # noqa: F401

_clear_caches = _dispatcher._clear_caches
_FLAGS = _dispatcher._FLAGS
_WARNED_FALLBACK = _dispatcher._WARNED_FALLBACK
