"""Compatibility shims for HyperParallel's and PyTorch's spellings, in one place.

Design (one screen)
-------------------
* **What is here.** Everything that exists only so that programs written for HyperParallel (or an
  older spelling) run unchanged and that the core does not need: ``hp_tensor_redistribution.py``,
  ``hp_op_dispatch.py`` / ``hp_skip.py`` / ``hp_parallel_ops*.py`` (its dispatch module paths),
  ``hp_utils.py`` / ``hp_shape_utils.py`` (its shape helpers), and ``platform.py`` (HyperParallel's
  platform object, a facade: HyperParallel removed its platform layer in 2026-09).
* **Module paths.** HyperParallel's ``hyper_parallel.core.*`` paths and ``hyper_parallel.platform``
  must exist where its programs import them; each is a file of a few lines that aliases the home
  module (``sys.modules``) or re-exports a package, with no logic. PyTorch's mirrored paths
  (``parallel``, ``placement_types``, ``device_mesh``, ``experimental``, ``debug``, ``fsdp``) are the
  same kind of re-export where they are not the home itself.
* **Not here.** HyperParallel's ``Layout`` and alias placements are first-class features of the
  DTensor core (``dtensor/layout.py``, ``dtensor/layout_builder.py``), and so are the HyperParallel
  methods the core classes carry: ``dtensor/layout_hp_methods.py`` / ``device_mesh_hp_methods.py``
  (``repeat_num``, ``to_dict``, ``alias_name``, ``mesh.rank``...; mixins of ``Layout`` and
  ``DeviceMesh``), ``dtensor/placement_lists.py`` (placement lists longer than the mesh) and
  ``dtensor/hp_module_names.py`` (the names HyperParallel imports from ``core.dtensor.dtensor``).
* **Imports.** compat imports the core, never the other way round (the ``core-below-compat``
  contract in pyproject.toml). docs/migrating_from_hyperparallel.md lists every difference.
"""
