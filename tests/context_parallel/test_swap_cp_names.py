"""Under ``hyper_parallel.swap`` the CP and DTensor-RNG names torchtitan 0.3.0 imports are hyper_parallel's
(issue 31 items 7 and 8), not raising placeholders; FlexAttention's ``flex_cp_allgather`` stays one."""
import importlib
import sys

import pytest

from tests.compat.test_swap_module import _write_pkg

TITAN_IMPORTS = '''
import torch
from torch.distributed.tensor.experimental._attention import (
    _context_parallel_shard,
    _enable_context_parallel_dispatcher,
    _HeadTailLoadBalancer,
    _PTRRLoadBalancer,
)
from torch.distributed.tensor.experimental._context_parallel._attention import flex_cp_allgather
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _PerDocumentHeadTailLoadBalancer


def seed(s, mesh):
    torch.distributed.tensor._random.manual_seed(s, mesh)
'''


def test_titan_cp_and_seed_names_map_to_hyper_parallel():
    from hyper_parallel import swap
    from hyper_parallel.context_parallel import load_balancer as lb, torch_private as tp
    from hyper_parallel.dtensor import random as hp_random
    root, name = _write_pkg({"cp": TITAN_IMPORTS})
    try:
        swap.install([name])
        m = importlib.import_module(name + ".cp")
        assert m._context_parallel_shard is tp._context_parallel_shard
        assert m._enable_context_parallel_dispatcher is tp._enable_context_parallel_dispatcher
        assert m._HeadTailLoadBalancer is lb._HeadTailLoadBalancer and m._PTRRLoadBalancer is lb._PTRRLoadBalancer
        assert m._PerDocumentHeadTailLoadBalancer is lb._PerDocumentHeadTailLoadBalancer
        with pytest.raises(swap.UnsupportedError, match="flex_cp_allgather"):
            m.flex_cp_allgather(None, None, 1, "")

        class CpuMesh:
            device_type = "cpu"
        try:
            with pytest.warns(UserWarning, match="may not have complete support on cpu"):
                m.seed(3, CpuMesh())
            assert hp_random.get_scheme() == "torch"
        finally:
            hp_random.set_scheme("hyper_parallel")
    finally:
        swap.uninstall()
        sys.path.remove(root)
