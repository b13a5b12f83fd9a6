"""The framework-neutral plan (``hyper_parallel.moe.plan``), handed to this folder by ``hyper_parallel.moe``.

The plan package sits above the platform in the layers contract, so this folder never imports it:
``hyper_parallel.moe`` calls :func:`install` when it is imported (the way the composition root
hands the DTensor class to the platform root).
"""
_PLAN = None


def install(plan_module) -> None:
    global _PLAN
    _PLAN = plan_module


def get():
    if _PLAN is None:
        raise RuntimeError("hyper_parallel expert parallelism: import hyper_parallel.moe first (it installs the "
                           "framework-neutral plan this platform folder uses)")
    return _PLAN
