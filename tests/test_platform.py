"""Platform selection and the collective byte model (single process)."""
import pytest

from hyper_parallel import platform as plat
from hyper_parallel.platform import comm_record as rec


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
