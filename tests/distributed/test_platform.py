"""Platform selection and the collective byte model (single process)."""
import pytest

from hyper_parallel import platform as plat
from hyper_parallel.distributed import comm_record as rec


def test_singleton_and_detection(monkeypatch):
    assert plat.get_platform() is plat.get_platform()
    assert plat.get_platform().platform_type.value == "torch"
    monkeypatch.setenv("HYPER_PARALLEL_PLATFORM", "torch")
    assert plat._detect() == "torch"
    monkeypatch.setenv("HYPER_PARALLEL_PLATFORM", "jax")
    with pytest.raises(ValueError, match="HYPER_PARALLEL_PLATFORM='jax'"):
        plat._detect()
    monkeypatch.delenv("HYPER_PARALLEL_PLATFORM")
    assert plat._detect() == "torch"


def test_bytes_model():
    assert rec.bytes_sent(rec.ALL_GATHER, 100, 4) == 300
    assert rec.bytes_sent(rec.ALL_REDUCE, 100, 4) == 150
    assert rec.bytes_sent(rec.REDUCE_SCATTER, 400, 4) == 300
    assert rec.bytes_sent(rec.ALL_TO_ALL, 400, 4) == 300
    assert rec.bytes_sent(rec.ALL_GATHER, 100, 1) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        rec.bytes_sent("gossip", 1, 2)


def test_bytes_model_rooted():
    assert rec.bytes_sent(rec.BROADCAST, 100, 4, is_src=True) == 300
    assert rec.bytes_sent(rec.BROADCAST, 100, 4, is_src=False) == 0
    assert rec.bytes_sent(rec.SCATTER, 400, 4, is_src=True) == 300
    assert rec.bytes_sent(rec.REDUCE, 400, 4, is_src=True) == 300
    assert rec.bytes_sent(rec.REDUCE, 400, 4, is_src=False) == 400
    assert rec.bytes_sent(rec.GATHER, 100, 4, is_src=True) == 0
    assert rec.bytes_sent(rec.GATHER, 100, 4, is_src=False) == 100
    assert rec.bytes_sent(rec.SEND, 100, 2) == 100 and rec.bytes_sent(rec.RECV, 100, 2) == 0


def test_prod_gradient_helpers():
    """The pieces of the division-free Partial(prod) backward, checked without processes."""
    import torch

    from hyper_parallel.distributed import differentiable as F

    for n in range(10):
        for k in range(1, 6):
            want = [c.numel() for c in torch.arange(n).chunk(k)]
            assert F._chunk_sizes(n, k) == want + [0] * (k - len(want)), (n, k)
    t = torch.tensor([[2.0, 0.0, 1.5], [3.0, 0.0, 0.0], [0.5, 4.0, -2.0], [5.0, 2.0, 0.0]], dtype=torch.float64)
    want = torch.stack([torch.cat([t[:r], t[r + 1:]]).prod(0) for r in range(t.shape[0])])
    assert torch.equal(F._exclusive_prod(t), want)
    assert torch.equal(F._exclusive_prod(t[:1]), torch.ones(1, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"WithValue: value shape \(2,\) differs from tensor shape \(3,\)"):
        F.WithValue.apply(torch.zeros(3, requires_grad=True), torch.zeros(2))
    x = torch.zeros(3, requires_grad=True)
    y = F.WithValue.apply(x, torch.tensor([1.0, 2.0, 3.0]))
    (y * torch.tensor([4.0, 5.0, 6.0])).sum().backward()
    assert y.tolist() == [1.0, 2.0, 3.0] and x.grad.tolist() == [4.0, 5.0, 6.0]


def test_dtensor_class_injected_for_torch_testing():
    """torch.testing's DTensor rule knows our DTensor by injection, not by a module-name string."""
    import hyper_parallel as hp
    from hyper_parallel.dtensor import patch_testing as testing_hook

    assert hp.DTensor in testing_hook._DTENSOR_CLASSES
    assert not hasattr(testing_hook, "_DTENSOR_MODULE")
    with pytest.raises(TypeError, match="register_dtensor_class: cls must be a class, got 3"):
        testing_hook.register_dtensor_class(3)
