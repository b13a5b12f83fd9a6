"""The planner's speed-ups (hyper_parallel.auto.cost's per-split caches, the FSDP sums memoised per search) change
no result: every scored layout of a few searches, its per-rank rows, the rejections, and a few ``evaluate_plan``
layouts off the beaten path (stage_layers, recompute_layers, interleaved) hash to the digests the cost model
gave before them (``DIGESTS``, recorded from the unoptimised code of 2026-11-28).

A digest that changes on purpose (the cost model's equations changed) is re-recorded with ``python -m
tests.auto.test_plan_results_fixed``; a speed-up must never change one."""
import hashlib
import json

from examples.llama.configs import get_config
from examples.llama.model import ModelArgs
from examples.llama.moe import MoEArgs
from hyper_parallel.auto import Cluster, evaluate_plan, explain_rejections, plan
from tests.auto.test_planner import _meta
from tests.auto.test_planner import llama_70b as _llama_70b


def _moe_16b():
    return ModelArgs(dim=2048, n_layers=24, n_heads=16, n_kv_heads=16, vocab_size=102400, multiple_of=256,
                     max_seq_len=4096, n_dense_layers=1,
                     moe=MoEArgs(num_experts=64, top_k=6, hidden_dim=1408, n_shared_experts=2))


def _calibrated_cpu(world):
    """A CPU world as ``Cluster.measure()`` leaves it (host costs set): the cost model's other branch."""
    return Cluster(world, 4, "64MiB", flops=1e10, op_overhead=1e-5, ac_op=1.5e-5, dtensor_op=2e-5,
                   optim=(1e-6, 3e-6), fsdp_unit={2: 1e-3, 8: 3e-3})


def _row(x):
    return [x["rank"], x["ranks"], x["stages"], x["blocks"], repr(x["in_flight"]), repr(x["flops"]),
            repr(x["compute"]), repr(x["busy"]), list(vars(x["memory"]).values()),
            sorted((k, repr(v)) for k, v in x["comm"].items()), x["fsdp_calls"]]


def _record(p):
    t = p.step_time
    return [p.summary(), list(p.layers_per_stage or []), list(vars(p.memory).values()),
            [repr(t.compute), repr(t.comm), repr(t.bubble), sorted((k, repr(v)) for k, v in t.comm_per_dim.items())],
            [_row(x) for x in p.per_rank]]


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:16]


def _searches():
    tiny, moe = get_config("tiny"), get_config("moe-tiny")
    yield "tiny-cpu8", _meta(tiny.model), _calibrated_cpu(8), dict(global_batch=16, seq_len=32)
    yield "moe-tiny-cpu8", _meta(moe.model), _calibrated_cpu(8), dict(global_batch=16, seq_len=32)
    yield "llama70b-h100x64", _meta(_llama_70b()), Cluster.preset("h100", 64), dict(global_batch=64, seq_len=4096)
    yield "moe16b-h100x32", _meta(_moe_16b()), Cluster.preset("h100", 32), dict(global_batch=64, seq_len=4096)


def _layouts():
    m = _meta(_llama_70b())
    c = Cluster.preset("h100", 64)
    kw = dict(global_batch=64, seq_len=4096)
    yield "70b-interleaved", evaluate_plan(m, c, degrees={"tp": 8, "pp": 8}, pp_schedule="interleaved1f1b",
                                           microbatches=16, sequence_parallel=True, activation_checkpointing="selective",
                                           **kw)
    yield "70b-stage-layers", evaluate_plan(m, c, degrees={"fsdp": 2, "tp": 4, "pp": 8}, microbatches=8,
                                            stage_layers=[9] + [10] * 6 + [11], activation_checkpointing="full",
                                            recompute_layers=3, **kw)
    yield "70b-cp-gpipe", evaluate_plan(m, c, degrees={"dp": 2, "tp": 8, "pp": 2, "cp": 2}, pp_schedule="gpipe",
                                        microbatches=4, activation_checkpointing="full", **kw)


def digests():
    out = {}
    for name, model, cluster, kw in _searches():
        ps = plan(model, cluster, top_k=10**6, **kw)
        out[name] = _digest([[_record(p) for p in ps], explain_rejections()])
    for name, p in _layouts():
        out[name] = _digest(_record(p))
    return out


DIGESTS = {
    "tiny-cpu8": "5acaf3db2f630d23",
    "moe-tiny-cpu8": "a15ba1d4fcd2eb02",
    "llama70b-h100x64": "0253718fe5a5d584",
    "moe16b-h100x32": "3364c44d59defa09",
    "70b-interleaved": "7577045aae167fd8",
    "70b-stage-layers": "c09333025683ef0f",
    "70b-cp-gpipe": "e9e83acde660a051",
}


def test_results_identical_to_the_unoptimised_cost_model():
    assert digests() == DIGESTS


if __name__ == "__main__":
    print(json.dumps(digests(), indent=4))
