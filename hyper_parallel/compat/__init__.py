"""Compatibility shims for HyperParallel's and PyTorch's spellings, in one place.

Design (one screen)
-------------------
* **What is here.** Everything that exists only so that programs written for HyperParallel (or an
  older spelling) run unchanged: ``hp_layout.py`` / ``hp_mesh.py`` (HyperParallel's methods of
  ``Layout`` and ``DeviceMesh``: ``repeat_num``, ``to_dict``, ``alias_name``, ``mesh.rank``...; the core
  classes inherit them as mixins, so a reader of ``dtensor/layout.py`` sees the one API),
  ``hp_placements.py`` (placement lists longer than the mesh), ``hp_dtensor_names.py`` (the names
  HyperParallel imports from ``core.dtensor.dtensor``), ``hp_tensor_redistribution.py``,
  ``hp_op_dispatch.py`` / ``hp_skip.py`` / ``hp_parallel_ops*.py`` (its dispatch module paths),
  ``hp_utils.py`` / ``hp_shape_utils.py`` (its shape helpers), and ``platform.py`` (HyperParallel's
  platform object, a facade: HyperParallel removed its platform layer in 2026-09).
* **Module paths.** HyperParallel's ``hyper_parallel.core.*`` paths and ``hyper_parallel.platform``
  must exist where its programs import them; each is a file of a few lines that aliases the home
  module (``sys.modules``) or re-exports a package, with no logic. PyTorch's mirrored paths
  (``parallel``, ``placement_types``, ``device_mesh``, ``experimental``, ``debug``, ``fsdp``) are the
  same kind of re-export where they are not the home itself.
* **Not here.** HyperParallel's ``Layout`` and alias placements are first-class features of the
  DTensor core (``dtensor/layout.py``, ``dtensor/layout_builder.py``).
* **Imports.** The mixins sit in the DTensor layer (the core classes inherit them); the facades sit at
  the top. docs/migrating_from_hyperparallel.md lists every difference.
"""
