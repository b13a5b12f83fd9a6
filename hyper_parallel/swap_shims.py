"""Stand-ins for private torch DTensor functions that swapped programs call (``hyper_parallel.swap``).

A facade with no logic: this path is :mod:`hyper_parallel.compat.torch.private_functions` (``sys.modules`` alias), where the code lives with
the rest of PyTorch's spelling (``hyper_parallel/compat/torch/``).
"""
import sys

import hyper_parallel.compat.torch.private_functions as _home

sys.modules[__name__] = _home
