"""Sharding rules of ``view_as_complex`` / ``view_as_real``: torchtitan's complex RoPE on TP-sharded
(heads) and sequence-sharded q/k, checked against one process (float64, values and gradients)."""
from __future__ import annotations

import pytest


def _rope(xq, freqs):
    import torch
    xc = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs).flatten(3)


def _body(placements):
    import torch
    import torch.distributed as dist

    import hyper_parallel as hp
    from hyper_parallel import Partial, Replicate, Shard
    from hyper_parallel.device_mesh import init_device_mesh
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,))
    g = torch.Generator().manual_seed(0)
    bs, seq, heads, hd = 2, 4 * ws, 2 * ws, 8
    x = torch.randn(bs, seq, heads, hd, dtype=torch.float64, generator=g)
    ang = torch.randn(seq, 1, hd // 2, dtype=torch.float64, generator=g)
    freqs = torch.polar(torch.ones_like(ang), ang)
    w = torch.randn(bs, seq, heads, hd, dtype=torch.float64, generator=g)
    ref_x = x.clone().requires_grad_()
    ref = _rope(ref_x, freqs)
    (ref * w).sum().backward()

    pl = [eval(placements, {"Shard": Shard, "Partial": Partial, "Replicate": Replicate})]
    if pl[0] == Partial():
        local = x / ws   # the Partial sum of the pieces is x; each piece's gradient is the full one
        dx = hp.DTensor.from_local(local.clone(), mesh, pl).requires_grad_()
        seq_freqs = hp.distribute_tensor(freqs, mesh, [Replicate()])
    else:
        dx = hp.distribute_tensor(x, mesh, pl).requires_grad_()
        fpl = [Shard(0)] if pl[0] == Shard(1) else [Replicate()]
        seq_freqs = hp.distribute_tensor(freqs, mesh, fpl)
    c = torch.view_as_complex(dx.reshape(bs, seq, heads, -1, 2))
    assert c.dtype == torch.complex128 and tuple(c.shape) == (bs, seq, heads, hd // 2)
    if pl[0] in (Shard(1), Shard(2)):
        assert c.placements == tuple(pl), c.placements  # no communication: the shards are kept
    out = torch.view_as_real(c * seq_freqs).flatten(3)
    torch.testing.assert_close(out.full_tensor(), ref.detach(), rtol=1e-12, atol=1e-12)
    (out * hp.distribute_tensor(w, mesh, out.placements if not out.placements[0].is_partial()
                                else [Replicate()])).sum().full_tensor().backward()
    torch.testing.assert_close(dx.grad.full_tensor(), ref_x.grad,
                               rtol=1e-12, atol=1e-12)
    # a DTensor sharded on the (real, imag) pair is replicated there first
    pair = hp.distribute_tensor(x.reshape(bs, seq, heads, -1, 2).transpose(-1, 0).contiguous(), mesh, [Shard(0)])
    pair = pair.transpose(-1, 0)
    torch.testing.assert_close(torch.view_as_complex(pair.contiguous()).full_tensor(),
                               torch.view_as_complex(x.reshape(bs, seq, heads, -1, 2)))
    with pytest.raises(ValueError, match="last dim must have size 2"):
        torch.view_as_complex(hp.distribute_tensor(torch.ones(4, 3, dtype=torch.float64), mesh, [Shard(0)]))
    return True


@pytest.mark.parametrize("placements", ["Shard(2)", "Shard(1)", "Partial()"])
def test_complex_rope_on_shards(dist_runner, placements):
    assert dist_runner.run(2, _body, placements) == [True, True]
