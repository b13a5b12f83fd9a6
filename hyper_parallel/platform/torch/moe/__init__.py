"""Expert-parallel mechanics on torch (a platform feature folder).

What it holds:

* :mod:`.comm` - the variable-split all_to_all (differentiable) and the count exchange;
* :mod:`.dispatch` - token dispatch/combine (from router outputs, or from rows already grouped by
  expert for the style);
* :mod:`.style` - ``ExpertParallel`` / ``ExpertTensorParallel`` (torchtitan's contract);
* :mod:`.grouped_mm` - ``torch._grouped_mm`` where torch runs it, an exact loop elsewhere;
* :mod:`.routing` - top-k routing (softmax/sigmoid, selection bias, group-limited);
* :mod:`.balance` - global token counts, aux-loss-free bias update, aux loss, load metrics.

The framework-neutral API is ``hyper_parallel.moe``; it reaches this folder by
``get_platform().feature("moe")``. Importing this package registers :mod:`.api` under that name
(the composition root imports every package in ``get_platform().feature_packages``).
"""
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.torch.moe import api

get_platform().register_feature("moe", api)

__all__ = ["api"]
