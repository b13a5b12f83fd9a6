"""All compatibility in one folder: HyperParallel's spelling and PyTorch's spelling.

Design (one screen)
-------------------
* ``hyperparallel/``: everything that exists only so that programs written for HyperParallel run
  unchanged: the files behind its ``hyper_parallel.core.*`` paths (``hyperparallel/core/``; the public
  package ``hyper_parallel.core`` points its ``__path__`` there) and its ``platform`` object.
* ``torch/``: PyTorch's spelling (see that package's docstring).
* **Entry points elsewhere are thin facades** with no logic: ``hyper_parallel/core/__init__.py``,
  ``hyper_parallel/platform/__init__.py`` (a ``sys.modules`` alias). PyTorch's mirrored paths at the root
  (``parallel``, ``placement_types``, ``device_mesh``, ``experimental``) are re-exports of the same kind.
* **Not here.** HyperParallel's ``Layout`` and alias placements are first-class features of the
  DTensor core (``dtensor/layout.py``, ``dtensor/layout_builder.py``), and so are the HyperParallel
  methods the core classes carry: ``dtensor/layout_hp_methods.py`` / ``device_mesh_hp_methods.py``
  (``repeat_num``, ``to_dict``, ``alias_name``, ``mesh.rank``...; mixins of ``Layout`` and
  ``DeviceMesh``) and ``dtensor/hp_module_names.py`` (the names HyperParallel imports from
  ``core.dtensor.dtensor``).
* **Imports.** compat imports the core, never the other way round (the ``core-below-compat``
  contract in pyproject.toml). docs/migrating_from_hyperparallel.md lists every difference.
"""
