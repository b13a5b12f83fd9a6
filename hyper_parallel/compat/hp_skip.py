"""SkipDTensorDispatch: run ops on DTensors as plain local-tensor ops.

The class lives in ``dtensor/dispatch_state.py`` (the DTensor layer reads its
state too); this is its historical path (same object).
"""
from hyper_parallel.dtensor.dispatch_state import SkipDTensorDispatch

__all__ = ["SkipDTensorDispatch"]
