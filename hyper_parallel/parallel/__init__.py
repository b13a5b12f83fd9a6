"""``torch.distributed.tensor.parallel``, spelled for hyper_parallel (``.style``, ``.api``, ``.loss`` too).

A facade with no logic: this path is :mod:`hyper_parallel.compat.torch.parallel` (``sys.modules`` alias), where the code lives with
the rest of PyTorch's spelling (``hyper_parallel/compat/torch/``).
"""
import sys

import hyper_parallel.compat.torch.parallel as _home

sys.modules[__name__] = _home
