"""``torch.compile`` support for hyper_parallel's DTensor (a platform feature folder).
from hyper_parallel.compile import compile_mode

What it holds: :mod:`.support`, everything torch-specific about compiling DTensor
programs - DTensor as a traceable wrapper subclass, one ``nonstrict_trace`` node per
DTensor op, layouts/placements/meshes as opaque value constants, the compile-mode switch
of the eager fast methods, and :func:`~.support.eager_hook` for module hooks that must
stay eager (FSDP's).

Why a folder of its own: this is feature mechanics built on torch's compiler, not an
adaptation of torch's basic services (tensors, collectives, autograd), which stay at the
root of ``platform/torch/``. The traced *collectives* (``compile_collectives.py``) stay at
the root: they are the other half of each raw collective (``collectives.py`` calls them
under ``torch.compiler.is_compiling()``), not compile-feature logic.

Layering: like the root, this folder imports nothing from ``hyper_parallel.core`` (or
``checkpoint``, ``debug``, the package root); the DTensor class and the dispatcher's
handler are injected by the core (``support.install``). The core reaches it through
``compile_mode``.
"""
