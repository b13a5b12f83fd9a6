"""fully_shard peak memory: a group's packed reduce_scatter input (one block's unsharded gradients in
one flat buffer) is dropped when the next group's post-backward runs, not at the end of backward,
and the gradients stay equal to the single-process ones (one distributed task, 2 ranks)."""
import copy

import torch
import torch.distributed as dist

import hyper_parallel as hp
from tests.fsdp.test_fsdp import DT, _data, _make, _shard


def _send_buffers_released():
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = hp.init_device_mesh("cpu", (world,))
    ref = _make()
    model = _shard(copy.deepcopy(ref), mesh)
    groups = [b._hp_fsdp_state.group for b in model.blocks]
    x, y = _data(0)
    xs, ys = x[rank::world], y[rank::world]
    seen = []

    def snapshot(grad):
        # block 0's backward has produced this gradient; blocks 2 and 1 have had their post-backward,
        # block 0's post-backward (its weights accumulate first) has released block 1's input
        seen.append([None if g._rs is None else (g._rs[0] is None, len(g._rs)) for g in groups])
        return grad

    for _ in range(2):  # the first step records the forward order
        seen.clear()
        h = model.inp.register_forward_hook(lambda m, a, out: [out.register_hook(snapshot), None][1])
        (model(xs) - ys).pow(2).mean().backward()
        h.remove()
    # block 2 (first reduced) and block 1: work handle dropped, flat output kept; block 0: in flight
    ok = seen == [[(False, 3), (True, 3), (True, 3)]]
    ok = ok and all(g._rs is None for g in groups)  # the final callback finished every group
    # gradients (accumulated over the two steps) equal the single-process ones
    for _ in range(2):
        (ref(x) - y).pow(2).mean().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        ok = ok and torch.allclose(p.grad.full_tensor(), q.grad, rtol=1e-12, atol=1e-12)
    return bool(ok) if ok else (seen, rank)


def test_fsdp_send_buffer_released_2(dist_runner):
    assert dist_runner.run(2, _send_buffers_released) == [True] * 2
