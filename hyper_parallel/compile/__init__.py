"""``torch.compile`` of DTensor programs: each DTensor op is one opaque node; the compiler sees local ops.

Design (one screen)
-------------------
* **Compile is a mode of the dispatcher.** The first time dynamo meets a DTensor, ``compile_mode``
  asks the op dispatcher to switch to compile mode (``EntryDispatcher.set_mode``): while dynamo traces,
  every op is one ``nonstrict_trace`` call whose body AOTAutograd runs natively, so sharding rules,
  caches and layout arithmetic are constant-folded and the graph holds only aten ops on local
  tensors and functional collectives. Outside tracing the eager path runs.
* **What lives here** (``compile_mode.py``): the opaque-node machinery (``traced_op``, the API
  methods' dynamo branch), layouts/placements/meshes registered as opaque constants, the fake-tensor
  answers DTensor's ``__tensor_unflatten__`` / ``__torch_dispatch__`` delegate to, ``eager_hook``
  (FSDP's hooks stay eager under compile), and the import hook that registers the nodes only when
  ``torch._dynamo`` is imported, so eager programs never pay its import.
* **Imports.** torch only. The op dispatcher hands its eager entry and its mode switch to
  :func:`compile_mode.install`; this package never imports the library above it.
* Docs: docs/design.md, "torch.compile".
"""
