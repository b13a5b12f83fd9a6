"""Debug helpers: :class:`CommDebugMode` counts the collectives hyper_parallel issues;
:func:`visualize_sharding` prints which ranks hold which block of a DTensor;
:func:`check_collectives` / :func:`set_check_collectives` turn on the desynchronisation check
(``HYPER_PARALLEL_CHECK_COLLECTIVES=1``) and :func:`set_collective_timeout` sets the one collective
timeout (``HYPER_PARALLEL_COLLECTIVE_TIMEOUT``); a failed collective raises :class:`CollectiveError`,
a desynchronised one :class:`CollectiveMismatchError` (docs/fault_tolerance.md)."""
from hyper_parallel.debug.comm_debug_mode import CommDebugMode
from hyper_parallel.debug.visualize_sharding import visualize_sharding
from hyper_parallel.distributed.collective_errors import (CollectiveError, CollectiveMismatchError, check_collectives,
                                            check_collectives_enabled, collective_timeout, set_check_collectives,
                                            set_collective_timeout)
from hyper_parallel.dtensor import register_export as _register_export

_register_export("CommDebugMode", CommDebugMode)  # HyperParallel's hyper_parallel.dtensor.CommDebugMode

__all__ = ["CommDebugMode", "visualize_sharding", "check_collectives", "set_check_collectives",
           "check_collectives_enabled", "set_collective_timeout", "collective_timeout", "CollectiveError",
           "CollectiveMismatchError"]
