"""The example MoE model trained with expert parallelism against one process, and its checkpoints.

Training (float64, 3 AdamW steps with clipping and the aux-loss-free bias step, 4 ranks each):

    ep2_efsdp2      --dp-shard 4 --ep 2           moe-tiny (softmax, top-2, 8 experts, shared expert)
    ep2_tp2_sp      --dp-shard 2 --ep 2 --tp 2 --sp   DeepSeek-style variant (sigmoid, group-limited, aux loss)
    ep4             --dp-shard 4 --ep 4           the DeepSeek-style variant
    fsdp2_tp2_no_ep --dp-shard 2 --tp 2 --sp      the DeepSeek-style variant without EP
    ep2_etp2        --dp-shard 2 --ep 2 --tp 2 --expert-tp   moe-tiny, experts tensor parallel over tp

Every step's loss and global expert counts, and the final parameters and expert biases, must match
one process to 1e-10 (float64; counts exactly). Also ``train.py --ep`` itself (its flags, its
load print).

Checkpoints: trained 2 steps at ep 4 and saved with examples/llama/checkpoint.py (DCP); loaded at
ep 2 (x efsdp 2), at ep 2 x tp 2 and in one plain process, the model (experts, biases) and the
optimizer states come back bit-exact under the same FQNs, and one more step matches.
"""
import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.checkpoint import StateDictOptions, get_state_dict
from examples.llama import checkpoint as ckpt
from examples.llama.configs import get_config
from examples.llama.data import TokenBatches, dp_shard
from examples.llama.model import build_model, loss_fn
from examples.llama.moe import update_expert_bias
from examples.llama.parallelize import clip_grad_norm_, dp_group_of, make_moe_mesh, parallelize_llama, train_loss
from examples.llama.reference import build_optimizer

STEPS = 3
TOL = 1e-10
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _cfg(variant):
    cfg = get_config("moe-tiny")
    if variant == "ds":  # DeepSeek-V3 style routing + the optional auxiliary loss
        moe = replace(cfg.model.moe, score_func="sigmoid", route_norm=True, n_groups=4, topk_groups=2,
                      aux_loss_coeff=0.01, load_balance_coeff=1e-2)
        cfg = replace(cfg, model=replace(cfg.model, moe=moe))
    return cfg


class _float64:
    def __enter__(self):
        self.prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.prev)


def _build(variant, layout):
    """layout: None (one process) or (dp_shard, ep, tp, sp[, expert_tensor_parallel])."""
    cfg = _cfg(variant)
    model = build_model(cfg.model, cfg.seed)
    mesh = None
    if layout is not None:
        dps, ep, tp, sp = layout[:4]
        etp = len(layout) > 4 and layout[4]
        if ep:
            mesh = make_moe_mesh("cpu", dps, ep, tp)
        else:  # no EP: the dense example's mesh; experts fully sharded like any other parameter
            mesh = hp.init_device_mesh("cpu", (1, dps, tp), mesh_dim_names=("dp", "dp_shard", "tp"))
        parallelize_llama(model, mesh, sequence_parallel=sp, src_data_rank=None, expert_tensor_parallel=etp)
    return model, build_optimizer(model.parameters(), cfg.optim), mesh


def _train(variant, model, opt, mesh, start, n):
    cfg = _cfg(variant)
    data = TokenBatches(seed=cfg.seed)
    dp, dp_rank, group = 1, 0, None
    if mesh is not None:
        outer, inner = ("efsdp", "ep") if "ep" in mesh.mesh_dim_names else ("dp", "dp_shard")
        dp = mesh.size(outer) * mesh.size(inner)
        dp_rank = mesh.get_local_rank(outer) * mesh.size(inner) + mesh.get_local_rank(inner)
        group = dp_group_of(mesh)
    losses, counts = [], []
    for step in range(start, start + n):
        x, y = data.get_batch(step, cfg.global_batch, cfg.seq_len)
        x, y = dp_shard(x, dp_rank, dp), dp_shard(y, dp_rank, dp)
        opt.zero_grad(set_to_none=True)
        g = train_loss(model, x, y, loss_fn).clone()
        clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
        opt.step()
        load = update_expert_bias(model, group)
        if dp > 1:
            dist.all_reduce(g, group=group)
            g /= dp
        losses.append(g.item())
        counts.append({k: v.tolist() for k, v in load.items()})
    return losses, counts


def _full(model, opt):
    msd, osd = get_state_dict(model, opt, options=FULL)
    return {"model": msd, "optim": osd}


def _reference(variant, steps):
    with _float64():
        torch.set_num_threads(1)
        model, opt, _ = _build(variant, None)
        losses, counts = _train(variant, model, opt, None, 0, steps)
        return losses, counts, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _parity_body(variant, layout, ref):
    with _float64():
        model, opt, mesh = _build(variant, layout)
        experts = model.layers["1"].moe.experts.w1
        assert isinstance(experts, hp.DTensor)
        assert experts.to_local().shape[0] == 8 // layout[0]  # sharded over ep (and efsdp) / dp_shard
        if len(layout) > 4:  # expert-tensor parallel: w1 [E, hidden, dim] also split on hidden over tp
            assert experts.to_local().shape[1] == _cfg(variant).model.moe.hidden_dim // layout[2]
        losses, counts = _train(variant, model, opt, mesh, 0, STEPS)
        full = _full(model, opt)["model"]
    ref_losses, ref_counts, ref_state = ref
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: loss {a} vs one process {b}"
    assert counts == ref_counts  # the same routing, every step, every layer (global counts)
    if dist.get_rank() == 0:
        assert sorted(full) == sorted(ref_state)
        for k, v in ref_state.items():
            torch.testing.assert_close(full[k], v, rtol=TOL, atol=TOL, msg=k)
        assert full["layers.2.moe.expert_bias"].abs().sum() > 0
    return losses


LAYOUTS = {  # name: (variant, (dp_shard, ep, tp, sp))
    "ep2_efsdp2": ("tiny", (4, 2, 1, False)),
    "ep2_tp2_sp": ("ds", (2, 2, 2, True)),
    "ep4": ("ds", (4, 4, 1, False)),
    "fsdp2_tp2_no_ep": ("ds", (2, 0, 2, True)),  # the MoE model without EP (FSDP x TP x SP)
    "ep2_etp2": ("tiny", (2, 2, 2, False, True)),  # ExpertTensorParallel on (ep, tp)
}
_REF = {}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_training_matches_one_process(dist_runner, name):
    variant, layout = LAYOUTS[name]
    if variant not in _REF:
        threads = torch.get_num_threads()
        try:
            _REF[variant] = _reference(variant, STEPS)
        finally:
            torch.set_num_threads(threads)
    dist_runner.run(4, _parity_body, variant, layout, _REF[variant], timeout=240)


def _train_script(argv, steps, ref_losses):
    from examples.llama.train import make_mesh, parse_args, train
    args = parse_args(argv)
    lines = []
    losses = train(args, steps, get_config(args.config), make_mesh(args), log=lambda *a: lines.append(a))
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, ref_losses)
    loads = [a[2] for a in lines if a[0] is None and "expert load" in str(a[2])]
    assert len(loads) == steps and "L1 max/mean" in loads[0] and "L2 max/mean" in loads[0], lines
    return True


def test_train_script_ep_flag(dist_runner):
    from examples.llama.reference import train_reference
    cfg, steps = get_config("moe-tiny"), 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref, _ = train_reference(cfg.model, steps, seed=cfg.seed, global_batch=cfg.global_batch,
                                 seq_len=cfg.seq_len, optim=cfg.optim)
    finally:
        torch.set_num_threads(threads)
    assert dist_runner.run(4, _train_script, ["--config", "moe-tiny", "--dp-shard", "4", "--ep", "2"],
                           steps, ref, timeout=240) == [True] * 4


def test_train_script_ep_bad_flags():
    from examples.llama.train import main
    with pytest.raises(SystemExit, match="--ep 3 borrows ranks from --dp-shard"):
        main(["--config", "moe-tiny", "--dp-shard", "4", "--ep", "3"])
    with pytest.raises(SystemExit, match="needs an MoE config"):
        main(["--config", "tiny", "--dp-shard", "2", "--ep", "2"])
    with pytest.raises(SystemExit, match="must divide the 16 experts"):
        main(["--config", "moe-demo", "--dp-shard", "6", "--ep", "6"])
    with pytest.raises(SystemExit, match="--ep must be >= 1, got 0"):
        main(["--config", "moe-tiny", "--ep", "0"])
    with pytest.raises(SystemExit, match="--expert-tp .* needs --ep > 1 and --tp > 1"):
        main(["--config", "moe-tiny", "--dp-shard", "2", "--ep", "2", "--expert-tp"])


# ------------------------------------------------------------------------------------ checkpoints

SAVE_AT = 2


def _save_body(root):
    with _float64():
        model, opt, mesh = _build("tiny", (4, 4, 1, False))
        assert model.layers["1"].moe.experts.w1.to_local().shape[0] == 2  # 8 experts over ep 4
        _train("tiny", model, opt, mesh, 0, SAVE_AT)
        ckpt.save(root, SAVE_AT, model, opt)
        state = _full(model, opt)
        losses, _ = _train("tiny", model, opt, mesh, SAVE_AT, 1)
        if dist.get_rank() == 0:
            torch.save({"state": state, "next_loss": losses[0]}, os.path.join(root, "ref.pt"))
    return True


def _load_body(root, layout):
    ref = torch.load(os.path.join(root, "ref.pt"))
    with _float64():
        model, opt, mesh = _build("tiny", layout)
        assert ckpt.resume(root, model, opt) == SAVE_AT
        got = _full(model, opt)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if rank0:
            want = ref["state"]
            assert sorted(got["model"]) == sorted(want["model"])
            assert "layers.1.moe.experts.w2" in got["model"] and "layers.1.moe.expert_bias" in got["model"]
            for k, v in want["model"].items():
                assert torch.equal(got["model"][k], v), k
            assert sorted(got["optim"]["state"]) == sorted(want["optim"]["state"])
            for fqn, st in want["optim"]["state"].items():
                for k, v in st.items():
                    assert torch.equal(got["optim"]["state"][fqn][k], v), (fqn, k)
        losses, _ = _train("tiny", model, opt, mesh, SAVE_AT, 1)
        assert abs(losses[0] - ref["next_loss"]) <= TOL * abs(ref["next_loss"])
    return True


def test_moe_checkpoint_across_ep_degrees(dist_runner, tmp_path):
    root = str(tmp_path / "ck")
    assert dist_runner.run(4, _save_body, root, timeout=240) == [True] * 4
    assert dist_runner.run(2, _load_body, root, (2, 2, 1, False), timeout=240) == [True] * 2
    assert dist_runner.run(4, _load_body, root, (2, 2, 2, False), timeout=240) == [True] * 4
    assert dist_runner.run(1, _load_body, root, None, timeout=240) == [True]
