"""Op dispatch, sharding rules and custom distributed functions."""
from hyper_parallel.dispatch import dispatcher  # noqa: F401  (installs the DTensor op handler)
from hyper_parallel.dispatch.rules.base import DistributedOp, Strategy, OpCall
from hyper_parallel.dispatch.rules.op_table import load_all as _load_all

_load_all()
from hyper_parallel.dispatch.dfunction import DFunction
from hyper_parallel.dtensor.dispatch_state import SkipDTensorDispatch
from hyper_parallel.dispatch.local_map import local_map, custom_shard
