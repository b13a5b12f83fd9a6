"""What ``get_platform().feature("moe")`` returns: the torch mechanics of expert parallelism."""
from hyper_parallel.platform.torch.moe.style import ExpertParallel, ExpertTensorParallel
from hyper_parallel.platform.torch.moe.dispatch import (DispatchHandle, Exchange, combine, count_ids, dispatch,
                                                        dispatch_sorted)
from hyper_parallel.platform.torch.moe.grouped_mm import (grouped_mm, grouped_mm_local, grouped_mm_loop,
                                                          native_supported)
from hyper_parallel.platform.torch.moe.balance import (load_balance_loss, load_metrics, tokens_per_expert,
                                                       update_expert_bias)
from hyper_parallel.platform.torch.moe.comm import STATS, reset_stats
from hyper_parallel.platform.torch.moe.routing import route_topk
from hyper_parallel.platform.torch.moe._plan import install as install_plan

__all__ = ["ExpertParallel", "ExpertTensorParallel", "DispatchHandle", "Exchange", "count_ids", "combine", "dispatch",
           "dispatch_sorted", "grouped_mm", "grouped_mm_local", "grouped_mm_loop", "native_supported", "load_balance_loss",
           "load_metrics", "tokens_per_expert", "update_expert_bias", "STATS", "reset_stats", "install_plan", "route_topk"]
