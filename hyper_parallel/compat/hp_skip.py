"""SkipDTensorDispatch: run ops on DTensors as plain local-tensor ops.

The class lives in ``dtensor/skip_and_replication.py`` (the DTensor layer reads its
state too); this is its historical path (same object).
"""
from hyper_parallel.dtensor.skip_and_replication import SkipDTensorDispatch

__all__ = ["SkipDTensorDispatch"]
