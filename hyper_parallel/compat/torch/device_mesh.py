"""``torch.distributed.tensor.device_mesh`` (and ``torch.distributed.device_mesh``), spelled for hyper_parallel.

Mirrors PyTorch's module (see :mod:`hyper_parallel.placement_types`); the mesh
lives in :mod:`hyper_parallel.dtensor.device_mesh`.
"""
from hyper_parallel.dtensor.device_mesh import DeviceMesh, init_device_mesh_torch as init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh"]
