"""``hyper_parallel.swap`` maps torch 2.13's private FSDP names torchtitan imports for EP > 1
(``_fsdp_common.ShardPlacementResult`` / ``FSDPMeshInfo`` / ``HSDPMeshInfo``, ``_fsdp_init._get_mesh_info``)
to hyper_parallel's, and binds torch's ``_StridedShard``, ``_utils.compute_local_shape_and_global_offset`` and
the static ``Shard.local_shard_size_and_offset`` to real hyper_parallel objects (no placeholders)."""
from __future__ import annotations

import sys

import pytest

from tests.compat.test_swap_module import _write_pkg

SRC = '''
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
from torch.distributed.tensor.placement_types import _StridedShard, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
import torch.distributed.tensor._utils as tutils


def strided():
    return _StridedShard(0, split_factor=2)


def shard_size_and_offset(size, num_chunks, rank):
    return Shard.local_shard_size_and_offset(size, num_chunks, rank)
'''


def test_fsdp_private_names_and_strided_shard():
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
        from hyper_parallel.placement_types import _StridedShard
        from hyper_parallel.swap_shims import compute_local_shape_and_global_offset
        assert mod.strided() == _StridedShard(0, split_factor=2) and isinstance(mod.strided(), _StridedShard)
        assert mod.compute_local_shape_and_global_offset is compute_local_shape_and_global_offset
        assert mod.tutils.compute_local_shape_and_global_offset is compute_local_shape_and_global_offset
        # torch 2.13's static method: (size, offset) of chunk `rank`; an empty chunk's offset is the size
        assert mod.shard_size_and_offset(7, 4, 3) == (1, 6) and mod.shard_size_and_offset(3, 4, 3) == (0, 3)
        assert swap.unsupported_names() == [], swap.unsupported_names()
    finally:
        swap.uninstall()
        sys.path.remove(root)
