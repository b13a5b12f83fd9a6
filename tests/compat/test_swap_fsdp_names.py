"""``hyper_parallel.swap`` maps torch 2.13's private FSDP names torchtitan imports for EP > 1
(``_fsdp_common.ShardPlacementResult`` / ``FSDPMeshInfo`` / ``HSDPMeshInfo``, ``_fsdp_init._get_mesh_info``)
to hyper_parallel's, and names why ``_StridedShard`` has no counterpart when a program uses it."""
from __future__ import annotations

import sys

import pytest

from tests.compat.test_swap_module import _write_pkg

SRC = '''
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
from torch.distributed.tensor.placement_types import _StridedShard


def strided():
    return _StridedShard(0, split_factor=2)
'''


def test_fsdp_private_names_and_strided_shard_hint():
    import importlib

    import hyper_parallel.fsdp as hfsdp
    from hyper_parallel import swap
    root, name = _write_pkg({"ep": SRC})
    try:
        swap.install([name])
        mod = importlib.import_module(name + ".ep")
        assert mod.ShardPlacementResult is hfsdp.ShardPlacementResult
        assert mod.FSDPMeshInfo is hfsdp.FSDPMeshInfo and mod.HSDPMeshInfo is hfsdp.HSDPMeshInfo
        assert mod._get_mesh_info is hfsdp.get_mesh_info
        with pytest.raises(swap.UnsupportedError, match=r"_StridedShard is not supported.*no _StridedShard "
                                                         r"placement.*dim_map.*models/utils\.py"):
            mod.strided()
        assert not any("_fsdp_common" in n or "_fsdp_init" in n for n in swap.unsupported_names())
    finally:
        swap.uninstall()
        sys.path.remove(root)
