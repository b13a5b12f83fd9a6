"""Context parallelism (issue 23): APIs, bad input, communication counts and bytes, activation memory.

* ``ContextParallel`` on the example Llama's attention (ring, Ulysses, hybrid) and the torch-style
  ``hyper_parallel.experimental.context_parallel`` context manager on a small SDPA model: a training
  step's loss, gradients (summed over cp by the test, as FSDP or the user would) and updated
  parameters equal one process (float64, 1e-10);
* every bad input of the issue raises on every rank, naming the value and what was expected;
* ring ``p2p`` sends ``cp - 1`` K/V blocks per rank per forward, Ulysses 4 all_to_alls per forward
  (4 more in backward); bytes equal ``hyper_parallel.context_parallel.comm``'s formulas;
* the attention's saved activations per rank at cp 4 are <= 0.3x those at cp 1 (saved_tensors_hooks).
"""
import pytest

TOL = 1e-10


# ----------------------------------------------------------------------------- the example Llama
def llama_reference(S, seed):
    """The example Llama twice in float64 (a reference trained one step in one process, and a copy to
    parallelize) and a batch: (ref, model, tokens, labels, token count, reference loss)."""
    import torch
    import torch.nn.functional as F
    from examples.llama.model import ModelArgs, build_model
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, max_seq_len=S)
    ref, model = build_model(args).double(), build_model(args).double()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (2, S), generator=g)
    labels = torch.randint(0, 50, (2, S), generator=g)
    n_tok = labels.numel()
    loss_ref = F.cross_entropy(ref(tokens).flatten(0, 1), labels.flatten(), reduction="sum") / n_tok
    loss_ref.backward()
    return ref, model, tokens, labels, n_tok, loss_ref


def check_cp_sums(loss, loss_ref, model, ref, group=None):
    """The loss and every parameter's gradient summed over the cp ranks (``group``; FSDP's job, or the
    user's) equal one process's; returns the summed loss."""
    import torch.distributed as dist
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    assert abs(float(total) - float(loss_ref)) < TOL, (float(total), float(loss_ref))
    errs = []
    for p, pr in zip(model.parameters(), ref.parameters()):
        gr = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        dist.all_reduce(gr, group=group)
        errs.append(float((gr - pr.grad).abs().max()))
    assert max(errs) < TOL, errs
    return float(total)


def _llama_cp(method, shape, S, lb, torch_mesh=False):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import hyper_parallel as hp
    from hyper_parallel.context_parallel import ContextParallel, cp_shard
    ref, model, tokens, labels, n_tok, loss_ref = llama_reference(S, 3)

    if torch_mesh:                               # a torch.distributed DeviceMesh is accepted too
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", shape)
    else:
        mesh = hp.init_device_mesh("cpu", shape)
    hp.parallelize_module(model, mesh, {"layers.*.attention": ContextParallel(method=method, load_balance=lb)})
    tok, lab, cos, sin = cp_shard(mesh, [tokens, labels, model.rope_cos[:S], model.rope_sin[:S]], [1, 1, 0, 0],
                                  load_balance=lb)
    model.rope_cos, model.rope_sin = cos, sin      # rotary tables of this rank's positions
    assert all(not hasattr(p, "placements") for p in model.parameters())   # parameters stay plain
    loss = F.cross_entropy(model(tok).flatten(0, 1), lab.flatten(), reduction="sum") / n_tok
    loss.backward()
    return check_cp_sums(loss, loss_ref, model, ref)


@pytest.mark.parametrize("method,shape,S,lb,tm", [("ring", (2,), 16, True, False), ("ulysses", (2,), 15, True, False),
                                                  ("hybrid", (2, 2), 22, True, False), ("ring", (4,), 16, False, True)])
def test_llama_context_parallel_style(dist_runner, method, shape, S, lb, tm):
    ws = 4 if len(shape) == 2 or shape[0] == 4 else 2
    dist_runner.run(ws, _llama_cp, method, shape, S, lb, tm)


# ----------------------------------------------------------------------------- torch's context manager
def _sdpa_model(torch, seed=0):
    nn, F = torch.nn, torch.nn.functional

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 16)
            self.pos = nn.Embedding(64, 16)
            self.wq, self.wk, self.wv = nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(16, 8)
            self.wo, self.head = nn.Linear(16, 16), nn.Linear(16, 40)

        def forward(self, tokens, pos):
            h = self.emb(tokens) + self.pos(pos)
            B, L, _ = h.shape
            q = self.wq(h).view(B, L, 4, 4).transpose(1, 2)
            k = self.wk(h).view(B, L, 2, 4).transpose(1, 2)
            v = self.wv(h).view(B, L, 2, 4).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return self.head(h + self.wo(o.transpose(1, 2).reshape(B, L, 16)))

    torch.manual_seed(seed)
    return Tiny().double()


def _ctx_manager_step(S, rotate, lb):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import hyper_parallel as hp
    from hyper_parallel.context_parallel import options
    from hyper_parallel.experimental import context_parallel, context_parallel_unshard, set_rotate_method
    ref, model = _sdpa_model(torch), _sdpa_model(torch)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 40, (2, S), generator=g)
    labels = torch.randint(0, 40, (2, S), generator=g)
    pos = torch.arange(S).unsqueeze(0).expand(2, S).contiguous()
    N = labels.numel()
    ref_logits = ref(tokens, pos)
    loss_ref = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), reduction="sum") / N
    loss_ref.backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()

    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),))
    set_rotate_method(rotate)
    old = options.enable_load_balance
    options.enable_load_balance = lb
    orig = tokens.clone()
    try:
        with context_parallel(mesh, buffers=[tokens, labels, pos], buffer_seq_dims=[1, 1, 1],
                              no_restore_buffers={labels}):
            assert tokens.shape[1] < S          # sharded in place
            logits = model(tokens, pos)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / N
            loss.backward()
            full_logits, = context_parallel_unshard(mesh, [logits.detach()], [1])
    finally:
        options.enable_load_balance = old
        set_rotate_method("allgather")
    assert torch.equal(tokens, orig)             # restored on exit
    assert labels.shape[1] < S                   # not restored (no_restore_buffers)
    torch.testing.assert_close(full_logits, ref_logits.detach(), rtol=0, atol=TOL)
    loss_all = loss.detach().clone()
    dist.all_reduce(loss_all)
    assert abs(float(loss_all) - float(loss_ref)) < TOL
    for p in model.parameters():
        dist.all_reduce(p.grad)
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    errs = [float((p - pr).abs().max()) for p, pr in zip(model.parameters(), ref.parameters())]
    assert max(errs) < TOL, errs
    return True


@pytest.mark.parametrize("ws,S,rotate,lb", [(2, 16, "allgather", True), (2, 13, "alltoall", True),
                                            (4, 18, "alltoall", False)])
def test_torch_context_manager_training_step(dist_runner, ws, S, rotate, lb):
    dist_runner.run(ws, _ctx_manager_step, S, rotate, lb)


def test_torch_names_exported():
    import torch.distributed.tensor.experimental as te
    import hyper_parallel.experimental as hx
    from hyper_parallel.experimental._attention import context_parallel_unshard, set_rotate_method
    assert "context_parallel" in te.__all__ and hx.context_parallel is not None
    assert hx.context_parallel_unshard is context_parallel_unshard and hx.set_rotate_method is set_rotate_method
    with pytest.raises(NotImplementedError, match="does not support using ring for kv shards rotation"):
        hx.set_rotate_method("ring")


# ----------------------------------------------------------------------------- bad input
def _bad_inputs():
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import hyper_parallel as hp
    from hyper_parallel import Shard, distribute_tensor
    from hyper_parallel.context_parallel import ContextParallel, context_parallel_attention as cpa
    from hyper_parallel.experimental import context_parallel
    ws = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,), mesh_dim_names=("cp",))
    q = torch.randn(1, 4, 8, 4, dtype=torch.float64)
    # a sequence dim that is not sharded on the cp dim
    qd = distribute_tensor(torch.randn(2, 4, 8, 4, dtype=torch.float64), mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"sequence dim 2 of query .* must be sharded on 1 cp mesh dim"):
        cpa(qd, qd, qd)
    with pytest.raises(ValueError, match=r"is not sharded on the cp mesh dim\(s\) 'cp'"):
        cpa(qd, qd, qd, cp_mesh_dim="cp")
    # a cp mesh dim that does not exist
    with pytest.raises(ValueError, match=r"cp mesh dim 'sp' does not exist .*its dims: \('cp',\)"):
        cpa(q, q, q, mesh, cp_mesh_dim="sp")
    with pytest.raises(ValueError, match="method='hybrid' needs a 2-D cp mesh"):
        cpa(q, q, q, mesh, method="hybrid")
    # a mask the method cannot honour
    with pytest.raises(NotImplementedError, match=r"mask 'bidirectional' .* cannot be honoured"):
        cpa(q, q, q, mesh, mask="bidirectional")
    with pytest.raises(NotImplementedError, match="an attn_mask tensor cannot be honoured"):
        with context_parallel(mesh):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    # a Ulysses head count that cannot be split
    q1 = torch.randn(1, 1, 8, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"Ulysses cannot split 1 query heads over cp degree {ws}"):
        cpa(q1, q1, q1, mesh, method="ulysses")
    # mismatched sequence shards between Q and K/V
    k = torch.randn(1, 4, 7, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="mismatched sequence shards between query and key/value: local sequence "
                                         "lengths query 8, key 7, value 7"):
        cpa(q, k, k, mesh)
    kd = distribute_tensor(torch.randn(1, 4, 16, 4, dtype=torch.float64), mesh, [Shard(1)])
    qs = distribute_tensor(torch.randn(1, 4, 16, 4, dtype=torch.float64), mesh, [Shard(2)])
    with pytest.raises(ValueError, match=r"mismatched sequence shards between query and key: query placements "
                                         r"\(Shard\(dim=2\),\), key placements \(Shard\(dim=1\),\)"):
        cpa(qs, kd, kd)
    # dropout_p > 0 without the distributed RNG
    with pytest.raises(NotImplementedError, match=r"dropout_p=0.1 > 0 is not supported"):
        cpa(q, q, q, mesh, dropout_p=0.1)
    # GQA without enable_gqa, through SDPA (as torch)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        with context_parallel(mesh):
            F.scaled_dot_product_attention(q, q[:, :2], q[:, :2])
    # other arguments
    with pytest.raises(ValueError, match=r"method must be one of \('ring', 'ulysses', 'hybrid'\), got 'zigzag'"):
        ContextParallel(method="zigzag")
    with pytest.raises(ValueError, match="rotate must be one of"):
        cpa(q, q, q, mesh, rotate="ring")
    with pytest.raises(ValueError, match=f"sequence length 1 is smaller than the cp degree {ws}"):
        cpa(q[:, :, :1], q[:, :, :1], q[:, :, :1], mesh, seq_len=1)
    with pytest.raises(ValueError, match=r"seq_dims\[1\]=3 is not a dim of buffer 1"):
        hp_cp = __import__("hyper_parallel.context_parallel", fromlist=["cp_shard"])
        hp_cp.cp_shard(mesh, [q, q[0]], [2, 3])
    with pytest.raises(ValueError, match="needs a 1-D cp mesh"):
        hp.parallelize_module(torch.nn.Linear(2, 2), hp.init_device_mesh("cpu", (1, ws)),
                              ContextParallel(method="ring"))
    return True


def test_bad_inputs(dist_runner):
    assert dist_runner.run(2, _bad_inputs) == [True, True]


# ----------------------------------------------------------------------------- counts and bytes
def _counts(method, shape, rotate):
    import torch
    import hyper_parallel as hp
    from hyper_parallel import CommDebugMode
    from hyper_parallel.context_parallel import comm, context_parallel_attention, cp_shard, shard_layout
    from hyper_parallel.context_parallel.plan import seg_len
    mesh = hp.init_device_mesh("cpu", shape)
    cp = mesh.size()
    S, B, H, Hk, D = 19, 2, 4, 2, 4
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(B, h, S, D, dtype=torch.float64, generator=g) for h in (H, Hk, Hk)]
    q, k, v = (t.requires_grad_() for t in cp_shard(mesh, full, [2, 2, 2]))
    with CommDebugMode() as fwd:
        out = context_parallel_attention(q, k, v, mesh, method=method, is_causal=True, rotate=rotate)
    with CommDebugMode() as bwd:
        out.sum().backward()
    me = mesh.get_coordinate()[0]
    lens = [seg_len(s) for s in shard_layout(S, cp, True)]
    esz = 8
    if method == "ring":
        kv = [n * B * Hk * 2 * D * esz for n in lens]
        f = comm.ring_forward(kv, me, rotate)
        if rotate == "p2p":
            assert dict(fwd.get_comm_counts()) == {"send": cp - 1, "recv": cp - 1}
            assert fwd.get_bytes()["send"] == f["bytes"]
            b = comm.ring_backward_p2p(kv, kv, me)
            assert bwd.get_comm_counts()["send"] == 2 * cp - 1 == b["count"]
            assert bwd.get_bytes()["send"] == b["bytes"]
        else:
            assert dict(fwd.get_comm_counts()) == {"all_gather": 1}
            assert fwd.get_bytes()["all_gather"] == f["bytes"]
            assert dict(bwd.get_comm_counts()) == {"all_gather": 1, "reduce_scatter": 1}
    else:
        assert dict(fwd.get_comm_counts()) == {"all_to_all": 4}
        assert dict(bwd.get_comm_counts()) == {"all_to_all": 4}
        if S % cp == 0 and H % cp == 0:
            n = lens[me]
            qb, kb = B * H * n * D * esz, B * Hk * n * D * esz
            assert fwd.get_bytes()["all_to_all"] == comm.ulysses_forward(qb, kb, kb, qb, cp)["bytes"]
    return True


@pytest.mark.parametrize("method,shape,rotate", [("ring", (4,), "p2p"), ("ring", (2,), "allgather"),
                                                 ("ulysses", (2,), "p2p")])
def test_comm_counts_and_bytes(dist_runner, method, shape, rotate):
    dist_runner.run(shape[0], _counts, method, shape, rotate)


def _ulysses_bytes_even():
    """Even split (S and heads divisible by cp): bytes of the 4 all_to_alls are the formula's."""
    import torch
    import hyper_parallel as hp
    from hyper_parallel import CommDebugMode
    from hyper_parallel.context_parallel import comm, context_parallel_attention
    mesh = hp.init_device_mesh("cpu", (2,))
    B, H, L, D = 2, 4, 8, 4
    q = torch.randn(B, H, L, D, dtype=torch.float64)
    with CommDebugMode() as m:
        context_parallel_attention(q, q, q, mesh, method="ulysses", is_causal=True)
    b = q.numel() * 8
    assert m.get_bytes()["all_to_all"] == comm.ulysses_forward(b, b, b, b, 2)["bytes"] == 4 * b // 2
    return True


def test_ulysses_bytes(dist_runner):
    dist_runner.run(2, _ulysses_bytes_even)


# ----------------------------------------------------------------------------- memory
def _saved_bytes(fn):
    import torch
    seen, total = set(), [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total[0], out


def _memory(method):
    import torch
    import hyper_parallel as hp
    from hyper_parallel.context_parallel import CausalMask, context_parallel_attention, cp_shard
    from hyper_parallel.context_parallel.api import RingPlan, _schedule
    from hyper_parallel.context_parallel import torch_mechanics
    mesh = hp.init_device_mesh("cpu", (4,))
    B, H, S, D = 1, 4, 64, 8
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(B, H, S, D, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3)]
    # cp 1: the same attention on the whole sequence in this process
    plan = RingPlan(None, _schedule((((0, S),),), 0, CausalMask()), [S], CausalMask().spec(), D ** -0.5, "p2p")
    cp1, _ = _saved_bytes(lambda: torch_mechanics.ring_attention(*full, plan))
    sdpa, _ = _saved_bytes(lambda: torch.nn.functional.scaled_dot_product_attention(*full, is_causal=True))
    shards = [t.detach().requires_grad_() for t in cp_shard(mesh, [t.detach() for t in full], [2, 2, 2])]
    cp4, out = _saved_bytes(lambda: context_parallel_attention(*shards, mesh, method=method, is_causal=True,
                                                               rotate="p2p"))
    assert cp4 <= 0.3 * cp1, (cp4, cp1)
    return cp4, cp1, sdpa


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_activation_memory_scales(dist_runner, method):
    res = dist_runner.run(4, _memory, method)
    assert all(r[0] <= 0.3 * r[1] for r in res)


def _intercepted_document_mask(method):
    """SDPA inside ContextParallel with ``attention_mask(DocumentMask)``: packed documents, exact."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import hyper_parallel as hp
    from hyper_parallel.context_parallel import ContextParallel, DocumentMask, attention_mask, cp_shard, cp_unshard

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    S = 27
    ids = [0] * 5 + [1] * 14 + [2] * 8                    # 3 packed documents of unequal lengths
    g = torch.Generator().manual_seed(2)
    full = [torch.randn(2, 4, S, 8, dtype=torch.float64, generator=g) for _ in range(3)]
    ref = [t.clone().requires_grad_() for t in full]
    i, j = torch.arange(S).unsqueeze(-1), torch.arange(S).unsqueeze(0)
    d = torch.tensor(ids)
    dense = (d[i] == d[j]) & (j <= i)
    out_ref = F.scaled_dot_product_attention(*ref, attn_mask=dense)
    out_ref.sum().backward()
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),))
    mod = hp.parallelize_module(Attn(), mesh, ContextParallel(method=method))
    sh = [t.requires_grad_() for t in cp_shard(mesh, full, [2, 2, 2])]
    with attention_mask(DocumentMask.from_doc_ids(ids)):
        out = mod(*sh)
    out.sum().backward()
    res = cp_unshard(mesh, [out.detach()] + [t.grad for t in sh], [2, 2, 2, 2])
    errs = [float((a - b).abs().max()) for a, b in zip(res, [out_ref.detach()] + [t.grad for t in ref])]
    assert max(errs) < TOL, errs
    return True


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_intercepted_document_mask(dist_runner, method):
    dist_runner.run(2, _intercepted_document_mask, method)


# ----------------------------------------------------------------------------- CP x TP on the example Llama
def _cp_tp(S, sp):
    """mesh (cp=2, tp=2): the example's Megatron TP plan (optionally SP) on mesh["tp"], ContextParallel on
    mesh["cp"]; loss and gradients (summed over cp) equal one process."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import hyper_parallel as hp
    from examples.llama.parallelize import parallelize_llama
    from hyper_parallel.context_parallel import ContextParallel, cp_shard
    ref, model, tokens, labels, N, loss_ref = llama_reference(S, 3)
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    parallelize_llama(model, mesh["tp"], sequence_parallel=sp)
    hp.parallelize_module(model, mesh["cp"], {"layers.*.attention": ContextParallel(method="ring")})
    tok, lab, cos, sin = cp_shard(mesh["cp"], [tokens, labels, model.rope_cos[:S], model.rope_sin[:S]],
                                  [1, 1, 0, 0])
    model.rope_cos, model.rope_sin = cos, sin
    logits = model(tok)
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    loss = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), reduction="sum") / N
    loss.backward()
    check_cp_sums(loss, loss_ref, model, ref, group=mesh.get_group("cp"))
    return True


@pytest.mark.parametrize("S,sp", [(18, False), (16, True)])
def test_llama_cp_x_tp(dist_runner, S, sp):
    dist_runner.run(4, _cp_tp, S, sp)
