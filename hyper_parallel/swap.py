"""``python -m hyper_parallel.swap``: run an unchanged ``torch.distributed.tensor`` program on hyper_parallel.

A facade with no logic: this path is :mod:`hyper_parallel.compat.torch.swap` (``sys.modules`` alias),
where the swap lives with its one table (``compat/torch/swap_table.py``); run as a script it calls that
module's ``main``.
"""
import sys

import hyper_parallel.compat.torch.swap as _home

if __name__ == "__main__":
    _home.main()
else:
    sys.modules[__name__] = _home
