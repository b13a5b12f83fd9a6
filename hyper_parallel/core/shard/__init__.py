"""Op dispatch, sharding rules and custom distributed functions."""
from hyper_parallel.core.shard import dispatcher  # noqa: F401  (installs the DTensor op handler)
from hyper_parallel.core.shard.ops.base import DistributedOp, Strategy, OpCall
from hyper_parallel.core.shard.ops.op_table import load_all as _load_all

_load_all()
from hyper_parallel.core.shard.dfunction import DFunction
from hyper_parallel.core.shard.skip import SkipDTensorDispatch
from hyper_parallel.core.shard.local_map import local_map, custom_shard
