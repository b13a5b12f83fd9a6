"""HyperParallel's own strict-mode errors, its own tests' programs and assertions (issue 33, item 3).

Each case is one of HyperParallel's error tests (``tests/torch/shard/ops/parallel_op_*.py`` in
mindspore-ai/hyper-parallel: the same inputs, meshes, placements and call, ``"cpu"`` for
``"npu"``), run on 8 ranks under strict layouts. It must raise HyperParallel's exception type with
the message substring its test asserts, and the message must **start** with the message
HyperParallel's rule raises for that call, word for word (written out here from its rule source
with the values of the call), followed by our own detail. Nothing is communicated before the
error. The last case checks the same through ``HYPER_PARALLEL_STRICT_LAYOUTS=1`` in a fresh process.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import DTensor, Layout, init_device_mesh
from hyper_parallel.core.dtensor import distribute_tensor
from hyper_parallel.core.placement_types import Replicate, Shard

VE, NIE = ValueError, NotImplementedError


def global_to_local(global_tensor, layout):
    """HyperParallel's test helper (tests/torch/shard/utils.py): this rank's slice, as a DTensor."""
    return distribute_tensor(global_tensor, layout.mesh, layout.placements)


def _dump(mesh_shape, names, tensor_map_names, rank_list):
    """HyperParallel's Layout.to_string() for a layout without partial."""
    return (f"Layout Configuration:\n  Mesh shape: {mesh_shape}\n  Alias Names: {names}\n"
            f"  Partial: {[None] * len(mesh_shape)}\n  Tensor Map: {tensor_map_names}\n"
            f"  Interleaved Parallel: No\n  Rank List: {rank_list}")


R8 = tuple(range(8))


def _mesh24():
    return init_device_mesh(device_type="cpu", mesh_shape=(2, 4), mesh_dim_names=("dp", "tp"))


# Each case: (label, build() -> zero-argument call, exception type, HyperParallel's asserted substrings,
# HyperParallel's full message). build() runs outside strict mode (it distributes the inputs).
def _cumsum():
    np.random.seed(42)
    x = torch.from_numpy(np.random.randn(8, 16).astype(np.float32))
    d = distribute_tensor(x, _mesh24(), (Shard(0), Replicate()))
    return lambda: torch.cumsum(d, dim=0)


def _expand():
    np.random.seed(42)
    x = torch.from_numpy(np.random.randn(8, 1).astype(np.float32))
    d = distribute_tensor(x, _mesh24(), (Replicate(), Shard(1)))
    return lambda: d.expand(8, 16)


def _isin():
    np.random.seed(42)
    e = torch.from_numpy(np.random.randint(0, 50, size=(8, 16)).astype(np.int32))
    t = torch.from_numpy(np.random.choice(np.arange(50), size=20, replace=False).astype(np.int32))
    mesh = _mesh24()
    de = distribute_tensor(e, mesh, (Shard(0), Replicate()))
    dt = distribute_tensor(t, mesh, (Shard(0), Replicate()))
    return lambda: torch.isin(de, dt)


def _layer_norm():
    np.random.seed(42)
    x = torch.from_numpy(np.random.randn(8, 16).astype(np.float32))
    layout = Layout((2, 4), ("dp", "tp"))
    dx = global_to_local(x, layout("dp", "tp"))
    w = global_to_local(torch.ones((16,)), layout("None",))
    b = global_to_local(torch.zeros((16,)), layout("None",))
    return lambda: torch.nn.functional.layer_norm(dx, (16,), w, b)


def _masked_scatter_data():
    np.random.seed(42)
    inp = np.random.randn(8, 8).astype(np.float32)
    mask = (np.random.rand(8, 8) > 0.5).astype(bool)
    src = np.random.randn(mask.sum() + 10).astype(np.float32)
    return torch.from_numpy(inp), torch.from_numpy(mask), torch.from_numpy(src)


def _masked_scatter(which):
    def build():
        inp, mask, src = _masked_scatter_data()
        mesh = _mesh24()
        rep = (Replicate(), Replicate())
        pl = {"input": ((Shard(0), Replicate()), rep, rep), "mask": (rep, (Replicate(), Shard(1)), rep),
              "source": (rep, rep, (Shard(0), Replicate()))}[which]
        di, dm, ds = (distribute_tensor(t, mesh, p) for t, p in zip((inp, mask, src), pl))
        return lambda: di.masked_scatter(dm, ds)
    return build


def _multinomial():
    np.random.seed(0)
    w = torch.from_numpy(np.abs(np.random.randn(4, 8)).astype(np.float32))
    d = distribute_tensor(w, _mesh24(), (Replicate(), Shard(1)))
    return lambda: d.multinomial(num_samples=2, replacement=True)


def _pad():
    np.random.seed(42)
    x = torch.from_numpy(np.random.randn(4, 4, 8, 8).astype(np.float32))
    d = distribute_tensor(x, _mesh24(), (Shard(0), Replicate(), Replicate(), Replicate()))
    return lambda: F.pad(d, (0, 0, 0, 0, 0, 0, 1, 1))


def _repeat_interleave():
    from hyper_parallel.core.dtensor import _build_layout
    np.random.seed(42)
    x = torch.from_numpy(np.random.randn(8, 16).astype(np.float32))
    d = global_to_local(x, _build_layout(_mesh24(), (Shard(0), Shard(1)), 2))
    return lambda: torch.repeat_interleave(d, 2, dim=1)


def _scatter(which):
    def build():
        mesh = _mesh24()
        pl = (Shard(0), Replicate())
        if which == "dim":
            torch.manual_seed(3456)
            x, i, s = torch.zeros(8, 8), torch.zeros(8, 8, dtype=torch.long), torch.randn(8, 8)
            dx, di, ds = (distribute_tensor(t, mesh, pl) for t in (x, i, s))
            return lambda: dx.scatter(0, di, ds)
        torch.manual_seed(4567 if which == "index" else 5678)
        x, i, s = torch.randn(8, 8), torch.zeros(8, 8, dtype=torch.long), torch.randn(8, 8)
        dx = distribute_tensor(x, mesh, pl)
        if which == "index":
            ds = distribute_tensor(s, mesh, pl)
            di = distribute_tensor(i, mesh, (Replicate(), Shard(1)))
        else:
            di = distribute_tensor(i, mesh, pl)
            ds = distribute_tensor(s, mesh, (Replicate(), Replicate()))
        return lambda: dx.scatter(1, di, ds)
    return build


def _softmax():
    np.random.seed(42)
    x = torch.from_numpy(np.random.randn(8, 16).astype(np.float32))
    d = global_to_local(x, Layout((2, 4), ("dp", "tp"))("dp", "tp"))
    return lambda: torch.softmax(d, 1)


def _sort():
    np.random.seed(42)
    x = torch.from_numpy(np.random.randn(8, 16).astype(np.float32))
    d = distribute_tensor(x, _mesh24(), (Shard(0), Replicate()))
    return lambda: d.sort(dim=0)


def _split():
    x_layout = Layout((4, 2), ("dp", "tp"))("dp", "tp")
    d = DTensor.from_local(torch.randn(4, 12), x_layout.mesh, x_layout.placements)
    return lambda: torch.split(d, 4, dim=0)


def _squeeze():
    x = torch.from_numpy(np.random.randn(8, 2).astype(np.float32))
    d = distribute_tensor(x, _mesh24(), (Shard(0), Replicate()))
    return lambda: d.squeeze(1)


def _topk():
    np.random.seed(42)
    x = torch.from_numpy(np.random.randn(8, 16).astype(np.float32))
    d = global_to_local(x, Layout((2, 4), ("dp", "tp"))("dp", "tp"))
    return lambda: torch.topk(d, 3, dim=1)


def _unbind():
    np.random.seed(42)
    x = torch.from_numpy(np.random.randn(4, 8).astype(np.float32))
    d = distribute_tensor(x, _mesh24(), (Shard(0), Replicate()))
    return lambda: torch.unbind(d, dim=0)


def _sdpa_qkv():
    np.random.seed(42)
    shape = (8, 16, 256, 64)
    return tuple(torch.from_numpy(np.random.randn(*shape).astype(np.float16)) for _ in range(3))


def _sdpa_kv_mismatch():
    mesh = init_device_mesh(device_type="cpu", mesh_shape=(8,), mesh_dim_names=("mp",))
    q, k, v = _sdpa_qkv()
    dq = distribute_tensor(q, mesh, (Shard(1),))
    dk = distribute_tensor(k, mesh, (Shard(1),))
    dv = DTensor.from_local(v, mesh, (Replicate(),))
    return lambda: F.scaled_dot_product_attention(dq, dk, dv, scale=1.0 / 8.0)


def _sdpa_kv_seq():
    mesh = init_device_mesh(device_type="cpu", mesh_shape=(8,), mesh_dim_names=("sp",))
    q, k, v = _sdpa_qkv()
    dq, dk, dv = (distribute_tensor(t, mesh, (Shard(2),)) for t in (q, k, v))
    return lambda: F.scaled_dot_product_attention(dq, dk, dv, scale=1.0 / 8.0)


def _ms_msg(i, dump):
    return (f"Operation masked_scatter: Input {i} (Layout: {dump}) is sharded. masked_scatter currently only "
            "supports fully Replicated (Unsharded) tensors due to sequential dependency on source elements.")


CASES = [
    ("cumsum", _cumsum, VE, ["Cannot perform sharding on normalized dimension 0"],
     "Operation cumsum: Cannot perform sharding on normalized dimension 0, but found sharding assignment: 1"),
    ("expand", _expand, VE, ["Cannot expand dimension 1 which is sharded"],
     "Operation expand: Cannot expand dimension 1 which is sharded."),
    ("isin", _isin, VE, ["'test_elements' must be unsharded"],
     "Operation isin: 'test_elements' must be unsharded. Current tensor_map: (1,)."),
    ("layer_norm", _layer_norm, VE, ["Cannot perform sharding on normalized dimension", "dimension 1"],
     "Operation layer_norm: Cannot perform sharding on normalized dimension 1, but found sharding assignment: 0"),
    ("masked_scatter input", _masked_scatter("input"), VE, ["is sharded"],
     _ms_msg(0, _dump((2, 4), ("dp", "tp"), ("dp", "None"), R8))),
    ("masked_scatter mask", _masked_scatter("mask"), VE, ["is sharded"],
     _ms_msg(1, _dump((2, 4), ("dp", "tp"), ("None", "tp"), R8))),
    ("masked_scatter source", _masked_scatter("source"), VE, ["is sharded"],
     _ms_msg(2, _dump((2, 4), ("dp", "tp"), ("dp",), R8))),
    ("multinomial", _multinomial, VE, ["must not be sharded"],
     "For 'multinomial', the last dimension (probability category dimension) must not be sharded (Replicated). "
     "Got layout map: ('None', 'tp'). Please redistribute the tensor to replicate the last dimension before "
     "calling multinomial."),
    ("pad", _pad, VE, ["does not support padding on a sharded dimension"],
     "Distributed Pad operator does not support padding on a sharded dimension. Dimension 0 (alias: dp) is "
     "sharded. Please redistribute the tensor to Replicate status on this dimension before padding."),
    ("repeat_interleave", _repeat_interleave, VE, ["Cannot perform sharding on params along the chosen dim"],
     "Operation repeat_interleave: Cannot perform sharding on params along the chosen dim"),
    ("scatter sharded dim", _scatter("dim"), VE, ["is sharded|supported"],
     "Operation scatter: Scatter along sharded dimension 0 is not supported. The target dimension must be "
     "Replicated (unsharded)."),
    ("scatter index layout", _scatter("index"), VE, ["Index tensor layout|must match input"],
     "Operation scatter: Index tensor layout (-1, 0) must match input tensor layout (1, -1)."),
    ("scatter src layout", _scatter("src"), VE, ["Src tensor layout|must match input"],
     "Operation scatter: Src tensor layout (-1, -1) must match input tensor layout (1, -1)."),
    ("softmax", _softmax, VE, ["requires the reduction axis to be un-sharded"],
     "Operation softmax: The axis dimension (in dim 1) is sharded (strategy is 4). This operation requires the "
     "reduction axis to be un-sharded."),
    ("sort", _sort, VE, ["sorting along a sharded dimension"],
     "For 'sort', sorting along a sharded dimension (dim 0 mapped to 1) is not supported. Please redistribute "
     "the tensor to Replicate status on this dimension before sorting."),
    ("split", _split, VE, ["Can not split tensor at sharded axis", "layout:"],
     "Can not split tensor at sharded axis[0], layout: " + _dump((4, 2), ("dp", "tp"), ("dp", "tp"), R8)),
    ("squeeze", _squeeze, VE, ["dimension should have size 1"],
     "For squeeze, dimension should have size 1, but got shape 2 at dimension 1."),
    ("topk", _topk, VE, ["Cannot perform sharding on params along the chosen dim"],
     "Operation topk: Cannot perform sharding on params along the chosen dim"),
    ("unbind", _unbind, VE, ["Unbinding a sharded dimension is not supported"],
     "For 'unbind', the dimension 0 is sharded (mapped to mesh axis 1). Unbinding a sharded dimension is not "
     "supported. Please redistribute the tensor to replicate this dimension first."),
    ("sdpa K/V strategies differ", _sdpa_kv_mismatch, VE, ["Key and Value must have identical"],
     "Key and Value must have identical sharding strategies.\nKey tensor_map: (-1, 0, -1, -1)\n"
     "Value tensor_map: (-1, -1, -1, -1)"),
    ("sdpa K/V sequence sharded", _sdpa_kv_seq, NIE, ["KV sequence sharding"],
     "KV sequence sharding is not supported for SDPA without Ring Attention.\nQuery sequence split num: 8\n"
     "Key/Value sequence split num: 8"),
]


def _check_one(label, build, exc, subs, full, msg, err):
    import re
    assert isinstance(err, exc), (label, type(err), msg)
    assert isinstance(err, hp.StrictLayoutError), (label, type(err))
    for s in subs:   # HyperParallel's own assertion (alternatives joined by "|" are its `or`)
        assert any(alt in msg for alt in s.split("|")) or re.search(s, msg), (label, s, msg)
    assert msg.startswith(full + "\n"), (label, msg)      # its rule's message first, word for word
    assert "strict layouts" in msg[len(full):], (label, msg)   # then ours


def _body():
    import warnings
    done = []
    for label, build, exc, subs, full in CASES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # pad: placements past the mesh's last dim are ignored (warned)
            call = build()
        for attempt in range(2):   # the second call is a cache hit: same error
            with hp.strict_layouts(), hp.CommDebugMode() as comm:
                with pytest.raises(Exception) as ei:
                    call()
            assert comm.get_total_counts() == 0, (label, comm.get_comm_counts())   # raised before any move
            _check_one(label, build, exc, subs, full, str(ei.value), ei.value)
        done.append(label)
    return done


def test_hyperparallel_error_cases_carry_its_messages(dist_runner):
    out = dist_runner.run(8, _body, timeout=600)
    assert out == [[c[0] for c in CASES]] * 8


def _env_body():
    from hyper_parallel.dispatch import modes
    assert modes.strict_layouts_mode() == "strict"
    done = []
    for label, build, exc, subs, full in CASES:
        if label not in ("cumsum", "sdpa K/V strategies differ", "scatter src layout"):
            continue
        call = build()
        with pytest.raises(Exception) as ei:
            call()
        _check_one(label, build, exc, subs, full, str(ei.value), ei.value)
        done.append(label)
    return done


def test_env_variable_strict_mode_gives_the_same_messages(tmp_path):
    """``HYPER_PARALLEL_STRICT_LAYOUTS=1`` set before the processes start, as HyperParallel users run."""
    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {os.getcwd()!r})\n"
        "from tests.harness import run_distributed\n"
        "from tests.dispatch.test_strict_hp_messages import _env_body\n"
        "out = run_distributed(8, _env_body, timeout=300)\n"
        "assert out == [['cumsum', 'scatter src layout', 'sdpa K/V strategies differ']] * 8, out\n"
        "print('ok')\n")
    env = dict(os.environ, HYPER_PARALLEL_STRICT_LAYOUTS="1")
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), (res.stdout[-2000:], res.stderr[-4000:])


def _all_strict_cases_body():
    """Every case of tests/dispatch/test_strict_layouts.py (1-D mesh): HyperParallel's message first, then ours."""
    from tests.dispatch.test_strict_layouts import _cases, _make
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    firsts = {}
    for label, f, inputs, exc, parts in _cases():
        dts = [_make(s[0], mesh, s[1], s[2] if len(s) > 2 else True) for s in inputs]
        with hp.strict_layouts():
            with pytest.raises(exc) as ei:
                f(*dts)
        head, _, rest = str(ei.value).partition("\n")
        assert not head.startswith("strict layouts") and "strict layouts" in rest, (label, str(ei.value))
        firsts[label] = head
    return firsts


def test_every_strict_case_starts_with_hyperparallels_message(dist_runner):
    firsts = dist_runner.run(2, _all_strict_cases_body)[0]
    assert firsts["sdpa embedding dim"].startswith("Query and Key/Value must have identical dim sharding strategy")
    assert firsts["sdpa mismatch"].startswith("Query and Key/Value must have identical batch sharding strategy")
    assert firsts["squeeze sharded singleton"] == ("For squeeze, dimension should not be distributed, but got "
                                                   "dimension 0 mapped to device axis tp.")
    assert firsts["scatter"] == "Operation scatter: Src tensor layout (-1, 0) must match input tensor layout (0, -1)."
    assert firsts["softmax"] == ("Operation softmax: The axis dimension (in dim -1) is sharded (strategy is 2). "
                                 "This operation requires the reduction axis to be un-sharded.")


def _keyword_forms_body():
    """Keyword spellings of the calls find the same message; warn-only mode carries it too."""
    import warnings
    from hyper_parallel.dispatch.modes import ImplicitRedistributionWarning
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = torch.arange(24.0).reshape(4, 6)
    d0 = distribute_tensor(x, mesh, (Shard(0),))
    d1 = distribute_tensor(x, mesh, (Shard(1),))
    t = distribute_tensor(torch.arange(4.0), mesh, (Shard(0),))
    cases = [
        (lambda: torch.cumsum(input=d0, dim=0),
         "Operation cumsum: Cannot perform sharding on normalized dimension 0, but found sharding assignment: 0"),
        (lambda: torch.topk(d1, k=2, dim=-1), "Operation topk: Cannot perform sharding on params along the chosen dim"),
        (lambda: F.pad(d1, pad=(1, 1)), "Distributed Pad operator does not support padding on a sharded dimension. "
         "Dimension 1 (alias: tp) is sharded."),
        (lambda: torch.isin(elements=d0, test_elements=t),
         "Operation isin: 'test_elements' must be unsharded. Current tensor_map: (0,)."),
        (lambda: torch.sort(d1, stable=True, dim=1),
         "For 'sort', sorting along a sharded dimension (dim 1 mapped to 0) is not supported."),
        (lambda: F.layer_norm(d1, normalized_shape=torch.Size([6])),
         "Operation layer_norm: Cannot perform sharding on normalized dimension 1, but found sharding assignment: 0"),
    ]
    for f, want in cases:
        with hp.strict_layouts():
            with pytest.raises(ValueError) as ei:
                f()
        assert str(ei.value).startswith(want), (want, str(ei.value))
        with hp.strict_layouts(warn_only=True), warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            f()
        msgs = [str(w.message) for w in rec if issubclass(w.category, ImplicitRedistributionWarning)]
        assert len(msgs) == 1 and msgs[0].startswith(want) and "bytes sent by the busiest rank" in msgs[0], msgs
    return len(cases)


def test_keyword_forms_and_warn_only(dist_runner):
    assert dist_runner.run(2, _keyword_forms_body) == [6, 6]
