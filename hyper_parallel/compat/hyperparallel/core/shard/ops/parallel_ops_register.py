"""HyperParallel's module path ``hyper_parallel.core.shard.ops.parallel_ops_register``: rule registration.

HyperParallel's registration functions for sharding rules, over our registry.
Constructing a :class:`DistributedOp` already registers it under its op name;
these functions are the explicit spelling HyperParallel code also uses.
"""
from hyper_parallel.dispatch.rules import base as _base


def register_distributed_op(op_name: str, op_class) -> None:
    """Serve op ``op_name`` with the rule instance ``op_class`` (HyperParallel's parameter name; replaces any
    earlier rule)."""
    if not isinstance(op_name, str) or not op_name:
        raise TypeError(f"register_distributed_op: op_name must be a non-empty string, got {op_name!r}")
    if not isinstance(op_class, _base.DistributedOp):
        raise TypeError(f"register_distributed_op: op_class must be a DistributedOp instance, got "
                        f"{type(op_class).__name__}")
    _base.register(op_name, op_class)


def get_distributed_op(op_name: str):
    """The rule registered for ``op_name``, or None."""
    return _base.get_rule(op_name)


__all__ = ["register_distributed_op", "get_distributed_op"]
