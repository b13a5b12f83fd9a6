"""``torch.distributed.tensor.experimental``, spelled for hyper_parallel.

A facade with no logic: this path is :mod:`hyper_parallel.compat.torch.experimental` (``sys.modules`` alias), where the code lives with
the rest of PyTorch's spelling (``hyper_parallel/compat/torch/``).
"""
import sys

import hyper_parallel.compat.torch.experimental as _home

sys.modules[__name__] = _home
