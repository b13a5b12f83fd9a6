"""Debug helpers: :class:`CommDebugMode` counts the collectives hyper_parallel issues;
:func:`visualize_sharding` prints which ranks hold which block of a DTensor."""
from hyper_parallel.debug.comm_debug_mode import CommDebugMode
from hyper_parallel.debug.visualize_sharding import visualize_sharding
from hyper_parallel.core.dtensor import register_export as _register_export

_register_export("CommDebugMode", CommDebugMode)  # HyperParallel's hyper_parallel.core.dtensor.CommDebugMode

__all__ = ["CommDebugMode", "visualize_sharding"]
