"""Debug helpers: :class:`CommDebugMode` counts the collectives hyper_parallel issues."""
from hyper_parallel.debug.comm_debug_mode import CommDebugMode

__all__ = ["CommDebugMode"]
