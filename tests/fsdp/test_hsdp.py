"""HyperParallel's hsdp(): levels 1/2/3, threshold, shard_size and the ZeRO-1/2 option - parity with one
process, collectives per step, and the exact per-rank bytes of what each level shards."""
import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.core.hsdp import HSDPModule, hsdp
from tests.fsdp.test_fsdp import TOL, _check_parity, _data, _make, _train

STEPS = 3
# (level, grads sharded?, params sharded?, re-gather in backward?)
LEVELS = {"level1": (False, True, False), "level2": (True, True, False), "level3": (True, True, True),
          "zero1": (False, False, False), "zero2": (True, False, False)}


def _storage_bytes(tensors):
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _run(shard_size, threshold, levels):
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = _make()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = _train(ref, ref_opt, STEPS)
    x, y = _data(STEPS)
    (ref(x) - y).pow(2).mean().backward()
    k = world if shard_size == -1 else shard_size
    out = {}
    for level in levels:
        grads_sharded, params_sharded, regather = LEVELS[level]
        label = f"hsdp {level} shard_size={shard_size} threshold={threshold}"
        model = _make()
        # HyperParallel sums gradients over the ranks; each rank's loss is a mean over its own
        # rows, so grad_scale = 1/world gives the whole batch's mean
        for b in model.blocks:
            hsdp(b, shard_size=shard_size, threshold=threshold, optimizer_level=level, grad_scale=1.0 / world)
        hsdp(model, shard_size=shard_size, threshold=threshold, optimizer_level=level, grad_scale=1.0 / world)
        assert isinstance(model, HSDPModule) and type(model).__name__ == "HSDPNet", label
        small = {n for n, p in model.named_parameters() if not isinstance(p, hp.DTensor)}
        want_small = {n for n, p in ref.named_parameters() if p.numel() * 8 < threshold * 1024}
        assert small == want_small, (label, small, want_small)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = _train(model, opt, STEPS, rank, world)
        _check_parity(model, ref, losses, ref_losses, label)
        # collectives of one more step (after the optimizer step changed the shards)
        n = x.shape[0] // world
        with hp.CommDebugMode() as comm:
            (model(x[rank * n:(rank + 1) * n]) - y[rank * n:(rank + 1) * n]).pow(2).mean().backward()
        groups = sum(1 for m in model.modules() if isinstance(m, HSDPModule) and m._hp_fsdp_state.group)
        c = comm.get_comm_counts()
        assert c.get("all_gather", 0) == groups * (2 if regather else 1), (label, c)
        if grads_sharded:
            assert c.get("reduce_scatter", 0) == groups, (label, c)
        reductions = c.get("all_reduce", 0)
        per_group = (0 if grads_sharded else 1) + (1 if k < world else 0)
        assert reductions == groups * per_group + (1 if small else 0), (label, c)
        for (nm, p), rp in zip(model.named_parameters(), ref.parameters()):
            if nm not in small:
                torch.testing.assert_close(p.grad.full_tensor(), rp.grad, **TOL, msg=f"{label} grad {nm}")
        # exact per-rank bytes
        me = rank % k
        shard_b = full_b = small_b = 0
        for nm, rp in ref.named_parameters():
            b = rp.numel() * 8
            if nm in small:
                small_b += b
                continue
            rows = list(torch.chunk(torch.arange(rp.shape[0]), k))
            shard_b += (rows[me].numel() if me < len(rows) else 0) * (rp.numel() // rp.shape[0]) * 8
            full_b += b
        dts = [p for p in model.parameters() if isinstance(p, hp.DTensor)]
        pb = _storage_bytes([p._local_tensor for p in dts])
        gb = _storage_bytes([p.grad._local_tensor for p in dts])
        ob = _storage_bytes([opt.state[p][s]._local_tensor for p in dts for s in ("exp_avg", "exp_avg_sq")])
        assert pb == (shard_b if params_sharded else full_b), (label, pb, shard_b, full_b)
        assert gb == (shard_b if grads_sharded else full_b), (label, gb, shard_b, full_b)
        assert ob == 2 * shard_b, (label, ob, shard_b)
        out[level] = (pb, gb, ob, full_b, small_b)
    return out


def test_hsdp_levels_2(dist_runner):
    dist_runner.run(2, _run, -1, 0, list(LEVELS))


def test_hsdp_threshold_shard_size_4(dist_runner):
    # threshold 1 KB keeps the biases and norm weights replicated; shard_size 2 = HSDP (2, 2)
    dist_runner.run(4, _run, 2, 1, ["level1", "level3", "zero2"])


def test_hsdp_bad_input():
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="shard_size must be a positive integer, but got 0"):
        hsdp(m, shard_size=0)
    with pytest.raises(ValueError, match="Optimizer level should in"):
        hsdp(m, optimizer_level="level4")
    with pytest.raises(ValueError, match="grad_scale must be float but got 1"):
        hsdp(m, grad_scale=1)
