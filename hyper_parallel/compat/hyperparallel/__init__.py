"""HyperParallel's spelling: everything that exists only so HyperParallel programs run unchanged.

* ``core/``: the files behind HyperParallel's ``hyper_parallel.core.*`` module paths (``hyper_parallel/core``
  points its ``__path__`` there): facades of the home modules, plus HyperParallel's own helpers the core
  does not need (``tensor_redistribution``, ``utils``/``shape_utils``, ``_op_dispatch``, ``parallel_ops*``).
* ``platform.py``: HyperParallel's platform object (the public path ``hyper_parallel.platform`` is an alias of it).
* ``module_paths.py``: the one helper behind the package facades.

Imports: this package imports the core, never the other way round (the ``core-below-compat``
contract in pyproject.toml). It imports nothing when imported itself, so loading one facade does not
load the others.
"""
