"""Parallel styles and parallelize_module: parity with the unsharded module (values and grads).

Every distributed case runs on 2 and 4 ranks; the cases are batched into one task
per world size (``_CASES``) to keep the suite lean. Constructor validation needs no
processes.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import (ColwiseParallel, NoParallel, Partial, PrepareModuleInput, PrepareModuleInputOutput,
                            PrepareModuleOutput, Replicate, RowwiseParallel, SequenceParallel, Shard,
                            parallelize_module)

TOL = dict(rtol=1e-5, atol=1e-5)


def _mesh():
    return hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))


def _full(y, mesh, placement, shape=None):
    """The global value of a style's output (a DTensor, or a local tensor laid out as ``placement``)."""
    if isinstance(y, hp.DTensor):
        return y.full_tensor()
    stride = None if shape is None else torch.empty(shape, device="meta").stride()
    return hp.DTensor.from_local(y, mesh, [placement], shape=shape, stride=stride).full_tensor()


def _check_grads(ref_mod, mod, reduce_plain=False):
    """Parameter grads equal the reference's; ``reduce_plain``: sum plain-tensor grads over ranks first."""
    pairs = list(zip(mod.named_parameters(), ref_mod.named_parameters()))
    assert pairs and len(pairs) == len(list(ref_mod.parameters()))
    for (n, p), (_, r) in pairs:
        g = p.grad
        if isinstance(g, hp.DTensor):
            g = g.full_tensor()
        elif reduce_plain:
            g = g.clone()
            dist.all_reduce(g)
        torch.testing.assert_close(g, r.grad, **TOL, msg=n)


def _chunk(t, dim=0):
    return t.chunk(dist.get_world_size(), dim=dim)[dist.get_rank()]


# ----------------------------------------------------------------------------- Colwise / Rowwise
def _linear_styles():
    mesh = _mesh()
    torch.manual_seed(0)
    for bias in (True, False):
        for use_local in (True, False):
            ref = nn.Linear(8, 12, bias=bias)
            x = torch.randn(3, 5, 8)
            col = parallelize_module(copy.deepcopy(ref), mesh, ColwiseParallel(use_local_output=use_local))
            out = col(x)
            assert isinstance(out, hp.DTensor) != use_local
            full = _full(out, mesh, Shard(-1))
            torch.testing.assert_close(full, ref(x), **TOL)
            (full * torch.arange(12.0)).sum().backward()
            (ref(x) * torch.arange(12.0)).sum().backward()
            _check_grads(ref, col)
            # Colwise with Replicate output; Rowwise with Replicate input and Shard(1) output
            ref.zero_grad()
            row_ref = nn.Linear(12, 8, bias=bias)
            col2 = parallelize_module(copy.deepcopy(ref), mesh, ColwiseParallel(output_layouts=Replicate()))
            row = parallelize_module(copy.deepcopy(row_ref), mesh,
                                     RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                     use_local_output=use_local))
            y = row(col2(x))
            yr = row_ref(ref(x))
            yfull = _full(y, mesh, Shard(1), shape=yr.shape)
            torch.testing.assert_close(yfull, yr, **TOL)
            yfull.pow(2).sum().backward()
            yr.pow(2).sum().backward()
            _check_grads(ref, col2)
            _check_grads(row_ref, row)
            ref.zero_grad()
            row_ref.zero_grad()
            # Rowwise with its defaults: input Shard(-1) (a local slice of the features), output Replicate
            row_d = parallelize_module(copy.deepcopy(row_ref), mesh, RowwiseParallel(use_local_output=use_local))
            h = torch.randn(3, 5, 12)
            hl = _chunk(h, -1).clone().requires_grad_()
            y = row_d(hl)
            if use_local:
                assert not isinstance(y, hp.DTensor) and y.shape == (3, 5, 8)
            else:
                assert y.placements == (Replicate(),)
            y = y.full_tensor() if isinstance(y, hp.DTensor) else y
            hr = h.clone().requires_grad_()
            yr = row_ref(hr)
            torch.testing.assert_close(y, yr, **TOL)
            w = torch.randn(3, 5, 8)
            (y * w).sum().backward()
            (yr * w).sum().backward()
            _check_grads(row_ref, row_d)
            torch.testing.assert_close(hl.grad, _chunk(hr.grad, -1), **TOL)
            row_ref.zero_grad()


def _embedding_styles():
    mesh = _mesh()
    torch.manual_seed(0)
    ref = nn.Embedding(10, 8)
    ids = torch.randint(0, 10, (3, 5))
    cases = [  # (style, placement of a local output)
        (RowwiseParallel(), Replicate()),
        (RowwiseParallel(output_layouts=Shard(1), use_local_output=False), None),
        (RowwiseParallel(output_layouts=Shard(1)), Shard(1)),
        (ColwiseParallel(output_layouts=Replicate()), Replicate()),
        (ColwiseParallel(), Shard(-1)),                          # default output: Shard(-1)
        (ColwiseParallel(use_local_output=False), None),
    ]
    for style, local_pl in cases:
        ref.zero_grad()
        emb = parallelize_module(copy.deepcopy(ref), mesh, style)
        out = emb(ids)
        assert isinstance(out, hp.DTensor) == (local_pl is None), style
        if local_pl is None:
            want = style.output_layouts
            assert out.placements == ((Shard(2),) if want == Shard(-1) else (want,)), (style, out.placements)
        full = _full(out, mesh, local_pl, shape=(3, 5, 8))
        torch.testing.assert_close(full, ref(ids), **TOL, msg=repr(style))
        w = torch.randn(3, 5, 8)
        (full * w).sum().backward()
        (ref(ids) * w).sum().backward()
        _check_grads(ref, emb)


# ----------------------------------------------------------------------------- SequenceParallel
class _UserRMSNorm(nn.Module):
    """A hand-written per-token RMSNorm (like the example model's), registered below."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


SequenceParallel.register_module_type(_UserRMSNorm)


class _LateNorm(nn.Module):
    def forward(self, x):
        return x * 2.0


def _sp_case(mesh, ref, sd, use_local, shape, seed=None):
    """Run ``ref`` under SequenceParallel on the local sequence shard; return (full out, local x, ref x)."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    mod = parallelize_module(copy.deepcopy(ref), mesh, SequenceParallel(sequence_dim=sd, use_local_output=use_local))
    for p in mod.parameters():
        assert isinstance(p, hp.DTensor) and p.placements == (Replicate(),)
    x = torch.randn(shape) + 0.1
    xl = x.chunk(ws, dim=sd)[rank].clone().requires_grad_()
    if seed is not None:
        hp.manual_seed(seed)
    out = mod(xl)
    assert isinstance(out, hp.DTensor) != use_local
    if use_local:
        assert out.shape == xl.shape
    else:
        assert out.placements == (Shard(sd % len(shape)),)
    return mod, _full(out, mesh, Shard(sd)), xl, x


def _sequence_parallel_modules():
    mesh = _mesh()
    ws = dist.get_world_size()
    torch.manual_seed(1)
    makers = [lambda: nn.LayerNorm(6), lambda: nn.LayerNorm(6, bias=False), lambda: nn.RMSNorm(6),
              lambda: _UserRMSNorm(6), lambda: nn.Dropout(0.0), lambda: nn.Dropout(0.5).eval()]
    for make in makers:
        for sd in (1, 0, -2):
            for use_local in (False, True):
                ref = make()
                with torch.no_grad():
                    for p in ref.parameters():
                        p.normal_()
                shape = (3, 2 * ws, 6) if sd != 0 else (2 * ws, 3, 6)
                mod, outf, xl, x = _sp_case(mesh, ref, sd, use_local, shape)
                xr = x.clone().requires_grad_()
                yr = ref(xr)
                torch.testing.assert_close(outf, yr, **TOL, msg=f"{ref} sd={sd}")
                w = torch.randn(shape)
                (outf * w).sum().backward()
                (yr * w).sum().backward()
                torch.testing.assert_close(xl.grad, xr.grad.chunk(ws, dim=sd)[dist.get_rank()], **TOL)
                if list(ref.parameters()):
                    _check_grads(ref, mod)
    # Dropout in training mode: the mask of the sequence-sharded run equals the mask of the same
    # DTensor dropout on the input sharded on another dim (same seed: the layout-independent stream),
    # and backward uses the forward's mask.
    for sd, use_local in ((1, False), (0, True)):
        shape = (3, 4 * ws, 6) if sd else (4 * ws, 3, 6)
        _, outf, xl, x = _sp_case(mesh, nn.Dropout(0.5), sd, use_local, shape, seed=123)
        hp.manual_seed(123)
        rep = F.dropout(hp.distribute_tensor(x, mesh, [Shard(2)]), 0.5).full_tensor()
        torch.testing.assert_close(outf, rep, rtol=0, atol=0)
        kept = outf != 0
        assert 0.2 < kept.float().mean().item() < 0.8
        torch.testing.assert_close(outf[kept], 2 * x[kept], rtol=0, atol=0)
        w = torch.randn(shape)
        (outf * w).sum().backward()
        torch.testing.assert_close(xl.grad, (2 * w * kept).chunk(ws, dim=sd)[dist.get_rank()], rtol=0, atol=0)


class _BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(4), nn.BatchNorm1d(4))])
        self.late = _LateNorm()
        self.norm = nn.GroupNorm(2, 4)


def _sp_errors():
    mesh = _mesh()
    ws = dist.get_world_size()
    # as PyTorch: any module is accepted (no registration needed); it runs on the sequence-sharded
    # DTensor, so even a module that mixes positions gives the one-process values
    class _SeqMean(nn.Module):  # unregistered; subtracts the mean over the sequence (dim 1)
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(1.5))

        def forward(self, x):
            return (x - x.mean(1, keepdim=True)) * self.scale
    ref = _SeqMean()
    torch.manual_seed(7)
    x = torch.randn(2, 2 * ws, 4)
    mod = parallelize_module(copy.deepcopy(ref), mesh, SequenceParallel())
    out = mod(x.chunk(ws, dim=1)[dist.get_rank()])
    assert out.placements == (Shard(1),)
    want = ref(x)
    torch.testing.assert_close(out.full_tensor(), want)
    (out.full_tensor() ** 2).sum().backward()
    (want ** 2).sum().backward()
    torch.testing.assert_close(mod.scale.grad.full_tensor(), ref.scale.grad)
    net = parallelize_module(_BNNet(), mesh, {"late": SequenceParallel(use_local_output=True)})
    torch.testing.assert_close(net.late(x), 2 * x)
    with pytest.raises(TypeError, match="SequenceParallel: module must be an nn.Module"):
        SequenceParallel().apply(F.layer_norm, mesh)
    # the registry (compatibility) still lists the known per-token types
    SequenceParallel.register_module_type(_LateNorm)
    try:
        assert _LateNorm in SequenceParallel.supported_module_types()
    finally:
        SequenceParallel._registered_types.remove(_LateNorm)
    with pytest.raises(TypeError, match="register_module_type: module_type must be an nn.Module subclass"):
        SequenceParallel.register_module_type(F.layer_norm)
    # sequence_dim out of range for the actual input
    ln = parallelize_module(nn.Sequential(nn.LayerNorm(4)), mesh, {"0": SequenceParallel(sequence_dim=3)})
    with pytest.raises(ValueError, match=r"SequenceParallel on LayerNorm at '0': sequence_dim=3 is out of range"):
        ln(torch.randn(2, 4, 4))


# ----------------------------------------------------------------------------- NoParallel
def _no_parallel():
    mesh = _mesh()
    ws = dist.get_world_size()
    torch.manual_seed(2)
    ref = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))
    for in_l, out_l in ((None, None), (Shard(0), Shard(0)), (Replicate(), Shard(1))):
        for use_local in (True, False):
            ref.zero_grad()
            style = NoParallel(input_layout=in_l, output_layout=out_l, use_local_output=use_local)
            mod = parallelize_module(copy.deepcopy(ref), mesh, style)
            assert all(isinstance(p, hp.DTensor) and p.placements == (Replicate(),) for p in mod.parameters())
            seen = []
            mod.register_forward_pre_hook(lambda m, a: seen.append(a[0].placements))
            x = torch.randn(2 * ws, 6)
            xin = (_chunk(x) if in_l == Shard(0) else x).clone().requires_grad_()
            out = mod(xin)
            assert seen == [(Replicate(),)], seen   # the module runs on the whole input
            assert isinstance(out, hp.DTensor) != use_local
            out_pl = out_l or Replicate()
            if not use_local:
                assert out.placements == (out_pl,)
            outf = _full(out, mesh, out_pl, shape=(2 * ws, 5))
            xr = x.clone().requires_grad_()
            yr = ref(xr)
            torch.testing.assert_close(outf, yr, **TOL)
            w = torch.randn(2 * ws, 5)
            (outf * w).sum().backward()
            (yr * w).sum().backward()
            torch.testing.assert_close(xin.grad, _chunk(xr.grad) if in_l == Shard(0) else xr.grad, **TOL)
            _check_grads(ref, mod)


# ----------------------------------------------------------------------------- PrepareModule*
class _TwoOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 8)

    def forward(self, x):
        return self.lin(x), x.sum(-1)


def _prepare_output():
    mesh = _mesh()
    ws = dist.get_world_size()
    torch.manual_seed(3)
    for use_local in (True, False):
        # a tuple of outputs; the module ran on a batch shard (Shard(0)); the second output is left alone
        ref = _TwoOut()
        mod = parallelize_module(copy.deepcopy(ref), mesh, PrepareModuleOutput(
            output_layouts=(Shard(0), None), desired_output_layouts=(Replicate(), None),
            use_local_output=use_local))
        x = torch.randn(2 * ws, 6)
        xl = _chunk(x).clone().requires_grad_()
        y, s = mod(xl)
        assert isinstance(y, hp.DTensor) != use_local and not isinstance(s, hp.DTensor)
        y = y.full_tensor() if isinstance(y, hp.DTensor) else y
        xr = x.clone().requires_grad_()
        yr, sr = ref(xr)
        torch.testing.assert_close(y, yr, **TOL)
        torch.testing.assert_close(s, _chunk(sr), **TOL)
        w, v = torch.randn(2 * ws, 8), torch.randn(2 * ws)
        ((y * w).sum() + (s * _chunk(v)).sum()).backward()
        ((yr * w).sum() + (sr * v).sum()).backward()
        torch.testing.assert_close(xl.grad, _chunk(xr.grad), **TOL)
        _check_grads(ref, mod, reduce_plain=True)   # each rank saw its batch shard only
        # a single output, Shard(0) -> Shard(1)
        ref = nn.Linear(6, 8)
        mod = parallelize_module(copy.deepcopy(ref), mesh, PrepareModuleOutput(
            output_layouts=Shard(0), desired_output_layouts=Shard(1), use_local_output=use_local))
        xl = _chunk(x).clone().requires_grad_()
        _check_col_sharded_output(mod(xl), use_local, mesh, ref, x, xl, w)
        _check_grads(ref, mod, reduce_plain=True)


def _check_col_sharded_output(y, use_local, mesh, ref, x, xl, w):
    """``y`` = the module's (2*ws, 8) output laid out Shard(1): values and input grads vs ``ref``."""
    ws = dist.get_world_size()
    assert isinstance(y, hp.DTensor) != use_local
    if use_local:
        assert y.shape == (2 * ws, 8 // ws)
    else:
        assert y.placements == (Shard(1),)
    yf = _full(y, mesh, Shard(1))
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    torch.testing.assert_close(yf, yr, **TOL)
    (yf * w).sum().backward()
    (yr * w).sum().backward()
    torch.testing.assert_close(xl.grad, _chunk(xr.grad), **TOL)


def _prepare_input_output():
    mesh = _mesh()
    ws = dist.get_world_size()
    torch.manual_seed(4)
    ref = nn.Linear(6, 8)
    for use_local_input in (True, False):
        for use_local in (True, False):
            ref.zero_grad()
            mod = parallelize_module(copy.deepcopy(ref), mesh, PrepareModuleInputOutput(
                input_layouts=Shard(0), desired_input_layouts=Replicate(), use_local_input=use_local_input,
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=use_local))
            seen = []
            mod.register_forward_pre_hook(lambda m, a: seen.append(type(a[0])))
            x = torch.randn(2 * ws, 6)
            xl = _chunk(x).clone().requires_grad_()
            with hp.implicit_replication():   # plain weights meet a DTensor input when use_local_input=False
                y = mod(xl)
            assert seen == [torch.Tensor if use_local_input else hp.DTensor], seen
            _check_col_sharded_output(y, use_local, mesh, ref, x, xl, torch.randn(2 * ws, 8))
            _check_grads(ref, mod)   # the module saw the whole batch on every rank


class _KwMod(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x, *, bias, scale=1.0):
        return self.lin(x) * scale + bias.sum(0)


def _prepare_input_kwargs():
    mesh = _mesh()
    ws = dist.get_world_size()
    torch.manual_seed(5)
    ref = _KwMod()
    for use_local in (True, False):
        ref.zero_grad()
        mod = parallelize_module(copy.deepcopy(ref), mesh, PrepareModuleInput(
            input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),),
            input_kwarg_layouts={"bias": Shard(0), "scale": None},
            desired_input_kwarg_layouts={"bias": Replicate(), "scale": None}, use_local_output=use_local))
        seen = {}
        mod.register_forward_pre_hook(lambda m, a, kw: seen.update(x=a[0], **kw), with_kwargs=True)
        x, b = torch.randn(2 * ws, 6), torch.randn(2 * ws, 6)
        xl, bl = _chunk(x).clone().requires_grad_(), _chunk(b).clone().requires_grad_()
        with hp.implicit_replication():
            y = mod(xl, bias=bl, scale=0.5)
        typ = torch.Tensor if use_local else hp.DTensor
        assert type(seen["x"]) is typ and type(seen["bias"]) is typ and seen["scale"] == 0.5
        if not use_local:
            assert seen["bias"].placements == (Replicate(),)
        assert seen["bias"].shape == (2 * ws, 6)
        y = y.full_tensor() if isinstance(y, hp.DTensor) else y
        xr, br = x.clone().requires_grad_(), b.clone().requires_grad_()
        yr = ref(xr, bias=br, scale=0.5)
        torch.testing.assert_close(y, yr, **TOL)
        w = torch.randn(2 * ws, 6)
        (y * w).sum().backward()
        (yr * w).sum().backward()
        torch.testing.assert_close(xl.grad, _chunk(xr.grad), **TOL)
        torch.testing.assert_close(bl.grad, _chunk(br.grad), **TOL)
        _check_grads(ref, mod)
    # a keyword tensor not named in the layouts is passed through unchanged
    mod = parallelize_module(_KwMod(), mesh, PrepareModuleInput(input_kwarg_layouts={"scale": None},
                                                                desired_input_kwarg_layouts={"scale": None}))
    out = mod(torch.ones(2, 6), bias=torch.ones(3, 6))
    assert not isinstance(out, hp.DTensor) and out.shape == (2, 6)


# ----------------------------------------------------------------------------- plans
class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.gate = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x, scale=1.0):
        h = self.norm(x)
        return x + self.down(F.silu(self.up(h)) * self.gate(h)) * scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for l in self.layers:
            x = l(x)
        return x


def _plan_sp():
    mesh = _mesh()
    torch.manual_seed(0)
    ref = Net()
    net = copy.deepcopy(ref)
    plan = {
        "layers.*.norm": SequenceParallel(),
        "layers.*": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                       input_kwarg_layouts={"scale": None}, desired_input_kwarg_layouts={"scale": None},
                                       use_local_output=True),
        "layers.*.up": ColwiseParallel(input_layouts=Shard(1)),
        "layers.*.gate": ColwiseParallel(input_layouts=Shard(1)),
        "layers.*.down": RowwiseParallel(output_layouts=Shard(1)),
    }
    parallelize_module(net, mesh, plan)
    x = torch.randn(2, 4 * dist.get_world_size(), 8)
    xl = hp.distribute_tensor(x, mesh, [Shard(1)]).to_local()
    with hp.CommDebugMode() as fwd:
        out = net(xl)
    outf = hp.DTensor.from_local(out, mesh, [Shard(1)]).full_tensor()
    torch.testing.assert_close(outf, ref(x), **TOL)
    # per layer: up/gate share one all_gather; down reduce-scatters
    assert fwd.get_comm_counts() == {"all_gather": 2, "reduce_scatter": 2}, fwd.get_comm_counts()
    with hp.CommDebugMode() as bwd:
        (outf ** 2).sum().backward()
    ref_out = ref(x)
    (ref_out ** 2).sum().backward()
    # per layer: one reduce_scatter for up+gate's input grad, one all_gather for down's; the
    # replicated LayerNorm parameters' gradients (4 tensors) are left Partial, as in PyTorch ...
    assert bwd.get_comm_counts() == {"reduce_scatter": 2, "all_gather": 2}, bwd.get_comm_counts()
    assert net.layers[0].norm.weight.grad.placements == (Partial(),)
    # ... and summed at their first use, all in one flat all_reduce
    with hp.CommDebugMode() as use:
        _check_grads(ref, net)
    assert use.get_comm_counts()["all_reduce"] == 1, use.get_comm_counts()


def _plan_errors():
    mesh = _mesh()
    net = Net()
    # as PyTorch: a plan entry that matches nothing warns and is skipped
    with pytest.warns(UserWarning, match=r"plan entry 'layers\.\*\.nope' matches no submodule"):
        parallelize_module(net, mesh, {"layers.*.nope": ColwiseParallel()})
    with pytest.warns(UserWarning, match=r"plan entry 'layers\.1\.nope' matches no submodule"):
        parallelize_module(net, mesh, {"layers": {"1": {"nope": ColwiseParallel()}}})
    mesh2 = hp.init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="1-D"):
        parallelize_module(Net(), mesh2, {"layers.0.up": ColwiseParallel()})
    with pytest.raises(NotImplementedError,
                       match=r"^ColwiseParallel supports nn\.Linear and nn\.Embedding; "
                             r"got LayerNorm at 'layers\.0\.norm'$"):
        parallelize_module(Net(), mesh, {"layers.0.norm": ColwiseParallel()})
    with pytest.raises(NotImplementedError,
                       match=r"^RowwiseParallel supports nn\.Linear and nn\.Embedding; got Block at 'layers\.1'$"):
        parallelize_module(Net(), mesh, {"layers.1": RowwiseParallel()})
    with pytest.raises(TypeError, match="plan entry 'layers.0.up' must be a ParallelStyle"):
        parallelize_module(Net(), mesh, {"layers.0.up": "colwise"})
    with pytest.raises(TypeError, match="src_data_rank must be an int rank or None, got '0'"):
        parallelize_module(Net(), mesh, ColwiseParallel(), src_data_rank="0")
    # runtime mismatches name the module's path
    net = parallelize_module(Net(), mesh, {"layers.0": PrepareModuleInput(
        input_layouts=(Replicate(), Replicate()), desired_input_layouts=(Replicate(), Replicate()))})
    with pytest.raises(ValueError, match=r"PrepareModuleInput on Block at 'layers\.0': the module received 1 "
                                         r"positional inputs but input_layouts=.* has 2 entries"):
        net(torch.randn(2, 4, 8))
    net = parallelize_module(Net(), mesh, {"layers.0": PrepareModuleInput(
        input_layouts=(Replicate(), Replicate()), desired_input_layouts=(Replicate(), None))})
    with pytest.raises(TypeError, match=r"at 'layers\.0': input 1 is float, not a tensor"):
        net.layers[0](torch.randn(2, 4, 8), 2.0)
    net = parallelize_module(Net(), mesh, {"layers.1": PrepareModuleOutput(
        output_layouts=(Replicate(), None), desired_output_layouts=(Shard(0), None))})
    with pytest.raises(ValueError, match=r"PrepareModuleOutput on Block at 'layers\.1': the module returned 1 "
                                         r"outputs but output_layouts=.* has 2 entries"):
        net(torch.randn(2, 4, 8))
    net = parallelize_module(Net(), mesh, {"layers.0": PrepareModuleInput(
        input_layouts=Shard(0), desired_input_layouts=Replicate())})
    with pytest.raises(ValueError, match=r"input 0 is a DTensor with placements \(Replicate\(\),\) but its layout "
                                         r"is given as Shard\(dim=0\)"):
        net.layers[0](hp.distribute_tensor(torch.randn(2, 4, 8), mesh, [Replicate()]))


_CASES = [_linear_styles, _embedding_styles, _sequence_parallel_modules, _sp_errors, _no_parallel,
          _prepare_output, _prepare_input_output, _prepare_input_kwargs, _plan_sp, _plan_errors]


def _run_cases():
    for case in _CASES:
        case()


@pytest.mark.parametrize("world_size", [2, 4])
def test_styles(dist_runner, world_size):
    """Every style case (values and gradients against the unsharded module) on ``world_size`` ranks."""
    dist_runner.run(world_size, _run_cases)


# ----------------------------------------------------------------------------- constructor validation (no processes)
_BAD_ARGS = [
    (lambda: PrepareModuleInputOutput(input_layouts=Shard(0), desired_input_layouts=Replicate()), TypeError,
     r"missing 2 required keyword-only arguments: 'output_layouts' and 'desired_output_layouts'"),
    (lambda: PrepareModuleInputOutput(output_layouts=None, desired_output_layouts=None), ValueError,
     r"^PrepareModuleInputOutput: output_layouts is required"),
    (lambda: PrepareModuleInputOutput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(),),
                                      output_layouts=Replicate(), desired_output_layouts=Replicate()), ValueError,
     r"^PrepareModuleInputOutput: input_layouts and desired_input_layouts must have the same length, got "
     r"input_layouts=\(Shard\(dim=0\), None\) \(2 entries\) and "
     r"desired_input_layouts=\(Replicate\(\),\) \(1 entries\)"),
    (lambda: PrepareModuleInputOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0),
                                      use_local_input=1), TypeError,
     r"^PrepareModuleInputOutput: use_local_input must be a bool, got 1 \(int\)"),
    (lambda: PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(), Replicate())),
     ValueError, r"input_layouts and desired_input_layouts must have the same length"),
    (lambda: PrepareModuleInput(input_layouts=Shard(0)), ValueError,
     r"^PrepareModuleInput: desired_input_layouts is required when input_layouts is given"),
    (lambda: PrepareModuleInput(desired_input_layouts=Shard(0)), ValueError,
     r"^PrepareModuleInput: desired_input_layouts=\(Shard\(dim=0\),\) needs input_layouts"),
    (lambda: PrepareModuleInput(input_layouts=(None,), desired_input_layouts=(Replicate(),)), ValueError,
     r"desired_input_layouts\[0\]=Replicate\(\) but input_layouts\[0\] is None"),
    (lambda: PrepareModuleInput(input_layouts="Shard(0)", desired_input_layouts=Replicate()), TypeError,
     r"^PrepareModuleInput: input_layouts must be a Placement .* got 'Shard\(0\)' \(str\)"),
    (lambda: PrepareModuleInput(input_layouts=(Shard(0), 1), desired_input_layouts=(Replicate(), None)), TypeError,
     r"^PrepareModuleInput: input_layouts\[1\] must be a Placement .* got 1 \(int\)"),
    (lambda: PrepareModuleInput(input_kwarg_layouts={"y": Shard(0)}), ValueError,
     r"input_kwarg_layouts and desired_input_kwarg_layouts must have the same keys, got "
     r"input_kwarg_layouts=\{'y': Shard\(dim=0\)\} and desired_input_kwarg_layouts=None"),
    (lambda: PrepareModuleInput(input_kwarg_layouts=[Shard(0)]), TypeError,
     r"^PrepareModuleInput: input_kwarg_layouts must be a dict"),
    (lambda: PrepareModuleInput(input_kwarg_layouts={"y": "S"}, desired_input_kwarg_layouts={"y": Replicate()}),
     TypeError, r"input_kwarg_layouts\['y'\] must be a Placement"),
    (lambda: PrepareModuleInput(input_kwarg_layouts={"y": None}, desired_input_kwarg_layouts={"y": Replicate()}),
     ValueError, r"desired_input_kwarg_layouts\['y'\]=Replicate\(\) but input_kwarg_layouts\['y'\] is None"),
    (lambda: PrepareModuleInput(use_local_output="yes"), TypeError,
     r"^PrepareModuleInput: use_local_output must be a bool, got 'yes' \(str\)"),
    (lambda: PrepareModuleOutput(output_layouts=Shard(0)), TypeError,
     r"missing 1 required keyword-only argument: 'desired_output_layouts'"),
    (lambda: PrepareModuleOutput(output_layouts=(Shard(0), None), desired_output_layouts=Replicate()), ValueError,
     r"^PrepareModuleOutput: output_layouts and desired_output_layouts must have the same length"),
    (lambda: PrepareModuleOutput(output_layouts=Shard(0), desired_output_layouts=None), ValueError,
     r"^PrepareModuleOutput: desired_output_layouts is required when output_layouts is given"),
    (lambda: ColwiseParallel(input_layouts=(Shard(0),)), TypeError,
     r"^ColwiseParallel: input_layouts must be a Placement .* got \(Shard\(dim=0\),\) \(this argument takes one"),
    (lambda: ColwiseParallel(output_layouts="Shard(-1)"), TypeError,
     r"^ColwiseParallel: output_layouts must be a Placement"),
    (lambda: ColwiseParallel(use_local_output=None), TypeError, r"^ColwiseParallel: use_local_output must be a bool"),
    (lambda: RowwiseParallel(input_layouts=0), TypeError, r"^RowwiseParallel: input_layouts must be a Placement"),
    (lambda: RowwiseParallel(output_layouts=[Replicate()]), TypeError, r"^RowwiseParallel: output_layouts must be"),
    (lambda: SequenceParallel(sequence_dim="1"), TypeError,
     r"^SequenceParallel: sequence_dim must be an int .* got '1' \(str\)"),
    (lambda: SequenceParallel(sequence_dim=True), TypeError, r"^SequenceParallel: sequence_dim must be an int"),
    (lambda: SequenceParallel(use_local_output=0), TypeError, r"^SequenceParallel: use_local_output must be a bool"),
    (lambda: NoParallel(input_layout=(Replicate(),)), TypeError, r"^NoParallel: input_layout must be a Placement"),
    (lambda: NoParallel(output_layout=1), TypeError, r"^NoParallel: output_layout must be a Placement"),
    (lambda: NoParallel(use_local_output="no"), TypeError, r"^NoParallel: use_local_output must be a bool"),
]


@pytest.mark.parametrize("make,exc,match", _BAD_ARGS, ids=[f"bad{i}" for i in range(len(_BAD_ARGS))])
def test_constructor_validation(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_constructor_defaults_match_torch():
    """Argument names and defaults are PyTorch's (NoParallel: torchtitan's)."""
    import inspect

    from torch.distributed.tensor.parallel import style as tstyle
    for ours in (ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, PrepareModuleOutput,
                 PrepareModuleInputOutput):
        theirs = getattr(tstyle, ours.__name__)
        a = [(p.name, p.kind, p.default) for p in inspect.signature(ours.__init__).parameters.values()]
        b = [(p.name, p.kind, p.default) for p in inspect.signature(theirs.__init__).parameters.values()]
        assert a == b, (ours.__name__, a, b)
    # defaults resolve like PyTorch's
    assert ColwiseParallel().input_layouts == Replicate() and ColwiseParallel().output_layouts == Shard(-1)
    assert RowwiseParallel().output_layouts == Replicate() and RowwiseParallel().input_layouts is None
    assert SequenceParallel().sequence_dim == 1 and SequenceParallel().use_local_output is False
    assert PrepareModuleInput(input_layouts=Partial(), desired_input_layouts=Replicate()).input_layouts == (Partial(),)
