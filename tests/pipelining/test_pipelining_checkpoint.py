"""DCP checkpoints of the pipelined example Llama reshard across pipeline degrees.

Source: ``train.py --pp 2 --tp 2 --sp`` layout (4 ranks, stages of ``examples/llama/pipeline.py``)
trains 2 steps, saves with ``examples/llama/checkpoint.py`` (DCP + ``hyper_parallel.checkpoint``:
one module per rank whose parameter names are the whole model's, optimizer state keyed by those
names), records the full state and trains 3 more steps (the uninterrupted run). Targets load that
checkpoint at pp 1 with TP 2 (2 ranks, no pipeline), at pp 4 (4 ranks, 1F1B) and in this one
process (a plain model): every parameter and every AdamW state (``step``, ``exp_avg``,
``exp_avg_sq``) must be bit-exact (``torch.equal`` of full tensors), and the 3 resumed steps
within 1e-5 of the uninterrupted run (fp32; the layouts' reductions differ).
"""
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.checkpoint import get_state_dict
from examples.llama import checkpoint as ckpt
from examples.llama.configs import get_config
from examples.llama.data import TokenBatches
from examples.llama.model import build_model, loss_fn
from examples.llama.parallelize import parallelize_llama, train_loss
from examples.llama.reference import build_optimizer

SAVE_AT, MORE = 2, 3
LAYOUTS = {"pp2tp2": ["--pp", "2", "--tp", "2", "--sp"], "pp4": ["--pp", "4", "--pp-microbatches", "4"],
           "tp2": ["--tp", "2"], "single": []}


def _full(t):
    return t.full_tensor() if isinstance(t, hp.DTensor) else t


def _state(module, opt):
    """This rank's part of the full state: {"model": {fqn: tensor}, "optim": {fqn: {k: tensor}}}."""
    msd, osd = get_state_dict(module, opt)
    return {"model": {k: _full(v).detach().clone() for k, v in msd.items()},
            "optim": {k: {n: _full(v).detach().clone() for n, v in st.items()} for k, st in osd["state"].items()}}


def _build(layout):
    """(module for checkpoints, optimizer, step(i) -> global loss) of ``layout`` on this world."""
    from examples.llama import pipeline, train
    cfg = get_config("tiny")
    args = train.parse_args(["--config", "tiny", *LAYOUTS[layout]])
    data = TokenBatches(seed=cfg.seed)
    if args.pp > 1:
        pipeline.check_args(args, cfg, dist.get_world_size())
        mesh = train.make_mesh(args)
        pipe = pipeline.Pipeline(args, cfg, mesh)
        opt = build_optimizer(pipe.params, cfg.optim)

        def step(i):
            x, y = data.get_batch(i, cfg.global_batch, cfg.seq_len)
            return pipe.train_step(opt, x, y, cfg.optim.max_grad_norm)[0]
        return pipe.module, opt, step
    model = build_model(cfg.model, cfg.seed)
    if args.tp > 1:
        parallelize_llama(model, train.make_mesh(args), sequence_parallel=False, src_data_rank=None)
    opt = build_optimizer(model.parameters(), cfg.optim)

    def step(i):
        x, y = data.get_batch(i, cfg.global_batch, cfg.seq_len)
        opt.zero_grad(set_to_none=True)
        loss = train_loss(model, x, y, loss_fn)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
        opt.step()
        return loss.item()
    return model, opt, step


def _save_body(root):
    module, opt, step = _build("pp2tp2")
    for i in range(SAVE_AT):
        step(i)
    ckpt.save(root, SAVE_AT, module, opt)
    saved = _state(module, opt)
    more = [step(i) for i in range(SAVE_AT, SAVE_AT + MORE)]
    return saved, more


def _resume_body(root, layout):
    module, opt, step = _build(layout)
    start = ckpt.resume(root, module, opt, stage=LAYOUTS[layout][:2] == ["--pp", "4"])
    loaded = _state(module, opt)
    return start, loaded, [step(i) for i in range(start, start + MORE)]


def _union(parts):
    out = {"model": {}, "optim": {}}
    for p in parts:
        for k in out:
            for name, v in p[k].items():
                if name in out[k]:  # a replica (tp ranks of one stage): the same values
                    same = torch.equal(out[k][name], v) if k == "model" else \
                        all(torch.equal(out[k][name][n], v[n]) for n in v)
                    assert same, (k, name)
                out[k][name] = v
    return out


def _assert_exact(got, want):
    assert sorted(got["model"]) == sorted(want["model"])
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert sorted(got["optim"]) == sorted(want["optim"])
    for fqn, st in want["optim"].items():
        assert sorted(got["optim"][fqn]) == sorted(st), fqn
        for k, v in st.items():
            assert torch.equal(got["optim"][fqn][k], v), (fqn, k)


def test_checkpoint_reshards_across_pipeline_degrees(dist_runner, tmp_path):
    root = str(tmp_path / "ckpt")
    res = dist_runner.run(4, _save_body, root)
    want = _union([r[0] for r in res])
    more = res[0][1]
    assert all(r[1] == more for r in res)
    n_params = len(list(build_model(get_config("tiny").model).parameters()))
    assert len(want["model"]) == n_params and len(want["optim"]) == n_params
    # every rank of pp 2 x tp 2 saved only its stage's names; the checkpoint holds all of them
    assert all(len(r[0]["model"]) < n_params for r in res)
    for layout, world in (("tp2", 2), ("pp4", 4)):
        out = dist_runner.run(world, _resume_body, root, layout)
        assert all(o[0] == SAVE_AT for o in out), layout
        _assert_exact(_union([o[1] for o in out]), want)
        for o in out:
            torch.testing.assert_close(torch.tensor(o[2]), torch.tensor(more), rtol=0, atol=1e-5, msg=layout)
    start, loaded, losses = _resume_body(root, "single")   # this process, no process group
    assert start == SAVE_AT
    _assert_exact(loaded, want)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(more), rtol=0, atol=1e-5)
