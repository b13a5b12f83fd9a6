"""loss_parallel: cross-entropy on class-sharded logits equals the full cross-entropy, without gathering."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import Replicate, Shard


def _loss_parallel(uneven):
    ws = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    n, c = 6, (4 * ws + (3 if uneven else 0))
    logits = torch.randn(n, c, requires_grad=True)
    target = torch.randint(0, c, (n,))
    target[1] = -100  # ignored
    for reduction in ("mean", "sum", "none"):
        logits.grad = None
        ref = F.cross_entropy(logits, target, reduction=reduction)
        w = torch.randn(ref.shape)
        (ref * w).sum().backward()
        dl = hp.distribute_tensor(logits.detach(), mesh, [Shard(1)]).requires_grad_()
        dt = hp.distribute_tensor(target, mesh, [Replicate()])
        with hp.CommDebugMode() as comm:
            with hp.loss_parallel():
                loss = F.cross_entropy(dl, dt, reduction=reduction)
        # only [N]-sized reductions: max, sum-exp and the target logit; never the vocabulary
        assert set(comm.get_comm_counts()) == {"all_reduce"}, comm.get_comm_counts()
        assert comm.get_total_bytes() <= 3 * 2 * n * 4 + 64, comm.get_bytes()
        full = loss.full_tensor()
        torch.testing.assert_close(full, ref.detach(), rtol=1e-5, atol=1e-6)
        with hp.CommDebugMode() as bwd:
            (full * w).sum().backward()
        assert bwd.get_total_counts() == 0, bwd.get_comm_counts()
        assert dl.grad.placements == (Shard(1),)
        torch.testing.assert_close(dl.grad.full_tensor(), logits.grad, rtol=1e-5, atol=1e-6)
    # outside the context the class dim is gathered as usual
    loss = F.cross_entropy(dl, dt)
    torch.testing.assert_close(loss.full_tensor(), F.cross_entropy(logits.detach(), target))


def test_loss_parallel(dist_runner):
    dist_runner.run(2, _loss_parallel, False)
    dist_runner.run(4, _loss_parallel, True)
