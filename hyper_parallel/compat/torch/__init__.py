"""PyTorch's spelling: what lets a ``torch.distributed.tensor`` program run on hyper_parallel.

* ``placement_types.py``, ``device_mesh.py``, ``experimental.py``, ``parallel/``: the mirrors of torch's
  module paths (re-exports of the home objects). Their public paths ``hyper_parallel.placement_types``,
  ``.device_mesh``, ``.experimental``, ``.parallel`` are ``sys.modules`` aliases of these.
* ``swap_table.py``: the one table of which hyper_parallel object stands for each torch name, read by
  the swap and by ``tools/torch_tests/swap.py``.
* ``swap.py``: the opt-in import swap (``python -m hyper_parallel.swap``, an alias of it).
* ``private_functions.py``: stand-ins for private torch functions swapped programs call
  (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, ``_random.manual_seed``;
  also at the old path ``hyper_parallel.swap_shims``).

This package imports nothing when imported itself.
"""
