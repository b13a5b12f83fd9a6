"""The cost model's calibration and counts against the library's real execution (gloo ranks).

* ``Cluster.measure()`` on gloo returns positive, finite host costs and per-group-size collective fits, and the
  calibrated ``collective_time`` grows with the message.
* The counts the cost model prices equal what the library actually does in a TP step: the ops dispatched on
  DTensors in each block (a counting hook on ``DTensor.__torch_function__``), and the TP collectives of one
  training step (``CommDebugMode``), with and without sequence parallelism and activation checkpointing.
"""
import math

import pytest
import torch
import torch.distributed as dist

from examples.llama.configs import get_config
from examples.llama.model import Transformer, build_model


def _meta(name):
    cfg = get_config(name)
    with torch.device("meta"):
        return cfg, Transformer(cfg.model, init_seed=None)


def _measure_body():
    from hyper_parallel.auto import Cluster
    torch.set_num_threads(1)
    c = Cluster(dist.get_world_size(), 8, "1GiB").measure(repeats=3)
    n = dist.get_world_size()
    return dict(flops=c.flops, op=c.op_overhead, ac_op=c.ac_op, dtensor_op=c.dtensor_op, optim=c.optim,
                fsdp_unit=dict(c.fsdp_unit), comm=dict(c.comm_by_size), kinds=sorted(c.comm),
                small=c.collective_time("all_reduce", 2**10, n, True),
                large=c.collective_time("all_reduce", 2**22, n, True))


def test_measure_returns_positive_finite_host_costs_on_gloo(dist_runner):
    out = dist_runner.run(2, _measure_body)
    assert out[0] == out[1]  # every rank gets the slowest rank's numbers
    r = out[0]
    pos = lambda v: math.isfinite(v) and v > 0
    assert pos(r["flops"]) and pos(r["op"]) and pos(r["dtensor_op"]), r
    assert math.isfinite(r["ac_op"]) and r["ac_op"] >= 0, r
    plain, dtensor = r["optim"]
    assert pos(plain) and pos(dtensor) and dtensor > plain, r["optim"]  # an AdamW step on DTensors costs more
    assert set(r["fsdp_unit"]) == {2} and pos(r["fsdp_unit"][2]), r["fsdp_unit"]
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"):
        per_call, bw = r["comm"][(kind, 2)]
        assert math.isfinite(per_call) and per_call >= 0 and pos(bw), (kind, per_call, bw)
    assert r["kinds"] == ["all_gather", "all_reduce", "all_to_all", "p2p", "reduce_scatter"]  # other sizes: per step
    assert 0 < r["small"] < r["large"], (r["small"], r["large"])


CASES = [(False, "none"), (True, "none"), (False, "full"), (True, "full")]


def _counts_body(name):
    """tp2 on 2 ranks: per case, DTensor dispatches per block and in the whole forward, TP collectives of a step."""
    from hyper_parallel.auto import Cluster, evaluate_plan
    from hyper_parallel.auto.dry_run import _default_batch, _loss
    from hyper_parallel.debug import CommDebugMode
    from hyper_parallel.dtensor.dtensor import DTensor
    cfg, meta = _meta(name)
    out = []
    orig = DTensor.__dict__["__torch_function__"].__func__
    for sp, ac in CASES:
        p = evaluate_plan(meta, Cluster(2, 2, "1GiB"), degrees={"tp": 2}, global_batch=cfg.global_batch,
                          seq_len=cfg.seq_len, sequence_parallel=sp, activation_checkpointing=ac)
        model = p.apply(build_model(cfg.model, cfg.seed))
        x, y = _default_batch(p, dist.get_rank(), cfg.model.vocab_size)
        _loss(model(x), y).backward()  # warm the dispatcher's caches
        where = {"block": None}
        per_block, total = {}, [0]

        def counting(cls, func, types, args=(), kwargs=None):
            total[0] += 1
            if where["block"] is not None:
                per_block[where["block"]] = per_block.get(where["block"], 0) + 1
            return orig(cls, func, types, args, kwargs)

        hooks = []
        for bname, blk in model.layers.items():
            hooks.append(blk.register_forward_pre_hook(lambda m, a, b=bname: where.update(block=b)))
            hooks.append(blk.register_forward_hook(lambda m, a, o: where.update(block=None)))
        DTensor.__torch_function__ = classmethod(counting)
        try:
            with torch.no_grad():
                model(x)
        finally:
            DTensor.__torch_function__ = classmethod(orig)
            for h in hooks:
                h.remove()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        with CommDebugMode() as comm:  # one training step (the SP norms' gradients are reduced when read)
            _loss(model(x), y).backward()
            opt.step()
        out.append(dict(per_block=per_block, total=total[0], comm=dict(comm.get_comm_counts())))
        del model
        dist.barrier()
    return out


@pytest.mark.parametrize("name", ["tiny"])
def test_cost_model_counts_equal_the_dispatched_ops_and_collectives(dist_runner, name):
    from hyper_parallel.auto.cost import host_counts, tp_collectives
    from hyper_parallel.auto.model_stats import trace_model
    from hyper_parallel.auto.roles import infer_roles
    out = dist_runner.run(2, _counts_body, name)
    cfg, meta = _meta(name)
    info = infer_roles(meta, trace_model(meta, cfg.seq_len))
    hc = host_counts(info, trace_model(meta, cfg.seq_len))
    blocks = list(range(len(info.block_names)))
    assert hc.dt_tp[0] == 7  # q, k, v, o, gate, up, down: one linear each
    for (sp, ac), got in zip(CASES, out[0]):
        for i, b in enumerate(info.block_names):
            predicted = hc.dt_tp[i] + (hc.dt_norm[i] if sp else 0)
            assert got["per_block"][b.split(".")[-1]] == predicted, (sp, ac, b, got["per_block"], predicted)
        whole = sum(hc.dt_tp) + hc.top_dt_tp + ((sum(hc.dt_norm) + hc.top_dt_norm) if sp else 0)
        assert got["total"] == whole, (sp, ac, got["total"], whole)
        want = {}
        for (kind, _), cnt in tp_collectives(hc, blocks, sp, ac == "full", True, True).items():
            want[kind] = want.get(kind, 0) + cnt
        if sp:
            want["all_reduce"] = want.get("all_reduce", 0) + 1  # the SP norms' weight gradients
        assert {k: v for k, v in got["comm"].items() if v} == want, (sp, ac, got["comm"], want)
