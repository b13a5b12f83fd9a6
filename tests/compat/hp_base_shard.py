"""HyperParallel's basic sharded training program, as its ``tests/torch/shard/base_shard.py`` writes it.

Reproduced unchanged but for the device (``"cpu"`` for ``"npu"``, no ``torch_npu``) and its
``init_dist()`` (the test harness has joined the process group): an 8x8 ``matmul`` model,
``shard_module`` with a ``ShardingPlan`` on a ``(1, 8)`` ``("dp", "tp")`` mesh, inputs and labels
from ``DTensor.from_local``, labels redistributed to the prediction's placements, a
sum-of-squares loss, ``reduce_partial()``, ``loss.backward(torch.tensor(1.0 / repeat_num))``,
SGD under ``SkipDTensorDispatch`` for 2 steps, then HyperParallel's own assertions: the loss
and this rank's column of the weight gradient (``.cpu().detach().numpy()`` of the DTensor
gradient: its local piece) against one process at 1e-3. Used by
``tests/compat/test_hp_training_semantics.py::test_hyperparallel_base_shard_program``.
"""
import numpy as np
import torch
from torch import nn
from torch import optim

from hyper_parallel import DTensor, SkipDTensorDispatch, init_device_mesh
from hyper_parallel.core.placement_types import Shard, Replicate
from hyper_parallel.core.shard.sharding_plan import ShardingPlan
from hyper_parallel.core.shard.api import shard_module


class SimpleModel(nn.Module):
    """simple model"""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(8, 8))

    def forward(self, x):
        return torch.matmul(x, self.weight)


def mse_loss_sum(y_pred, y_true):
    error = torch.sub(y_pred, y_true)
    square_error = torch.square(error)
    mse = torch.sum(square_error)
    return mse


def init_dist():
    """HyperParallel's ``tests.torch.utils.init_dist`` here: the harness has joined the process group."""
    import torch.distributed as dist
    return dist.get_rank(), dist.get_world_size()


def test_base_shard():
    """HyperParallel's test body; returns what it compared (for the caller's further checks)."""
    rank, _ = init_dist()
    step = 2
    torch.manual_seed(1)
    np.random.seed(0)

    # -----------------------------------standalone----------------------------------
    # Ensure same seed for initialization
    torch.manual_seed(1)
    standalone_model = SimpleModel()
    standalone_optimizer = optim.SGD(standalone_model.parameters(), lr=0.01)
    torch.manual_seed(2)
    standalone_x = torch.randn(32, 8)
    torch.manual_seed(3)
    standalone_y = torch.randn(32, 8)
    for _ in range(step):
        standalone_loss = mse_loss_sum(standalone_model(standalone_x), standalone_y)
        standalone_loss.backward()
        standalone_grad = standalone_model.weight.grad.data.clone()
        standalone_optimizer.step()
        standalone_optimizer.zero_grad()

    # --------------------------------------dist-------------------------------------
    # Ensure same seed for initialization
    torch.manual_seed(1)
    dist_model = SimpleModel()
    mesh = init_device_mesh(device_type="cpu", mesh_shape=(1, 8), mesh_dim_names=("dp", "tp"))
    x_placements = (Replicate(), Replicate())
    w_placements = (Replicate(), Shard(1))
    sharding_plan = ShardingPlan(
        plan={"weight": w_placements},
        input_plan={"input": x_placements},
        output_plan={"output": w_placements}
    )
    dist_model = shard_module(dist_model, device_mesh=mesh, sharding_plan=sharding_plan)
    dist_optimizer = optim.SGD(dist_model.parameters(), lr=0.01)
    torch.manual_seed(2)
    dist_x_local = torch.randn(32, 8)
    dist_x = DTensor.from_local(dist_x_local, mesh, x_placements)
    torch.manual_seed(3)
    dist_y_local = torch.randn(32, 8)
    dist_y = DTensor.from_local(dist_y_local, mesh, x_placements)

    for _ in range(step):
        y_pred = dist_model(dist_x)
        y_shard = dist_y.redistribute(mesh, y_pred.placements)
        dist_loss = mse_loss_sum(y_pred, y_shard)
        dist_loss = dist_loss.reduce_partial()
        repeat_num = dist_loss.layout.repeat_num()
        backward_input = torch.tensor(1.0 / repeat_num)
        dist_loss.backward(backward_input)
        dist_grad = dist_model.weight.grad.data
        with SkipDTensorDispatch():
            dist_optimizer.step()
            dist_optimizer.zero_grad()

    assert np.allclose(standalone_loss.cpu().detach().numpy(),
                       dist_loss.to_local().cpu().detach().numpy(),
                       rtol=1e-3, atol=1e-3)

    start = rank
    end = rank + 1
    standalone_grad_slice = standalone_grad[:, start:end]

    assert np.allclose(standalone_grad_slice.cpu().detach().numpy(),
                       dist_grad.cpu().detach().numpy(),
                       rtol=1e-3, atol=1e-3)
    return standalone_loss.detach(), dist_loss, standalone_grad_slice, dist_grad, dist_model
