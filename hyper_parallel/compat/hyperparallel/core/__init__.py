"""The files behind HyperParallel's ``hyper_parallel.core.*`` paths (loaded under those names).

``hyper_parallel/core/__init__.py`` points its ``__path__`` here, so ``hyper_parallel.core.dtensor.layout``
is ``dtensor/layout.py`` of this folder. Import them by their HyperParallel names, never by this path.
Each file is either a facade (``sys.modules`` alias of the home module, or a package re-export through
``module_paths.package_getattr``) or one of HyperParallel's own helpers that the core does not need
(``dtensor/tensor_redistribution.py``, ``utils/``, ``shard/_op_dispatch.py``, ``shard/ops/parallel_ops*.py``).
"""
