"""``torch.testing`` with one DTensor and one plain tensor (issue 33, item 2).

PyTorch 2.13's ``assert_close`` and ``TestCase.assertEqual`` refuse a DTensor compared with a
non-DTensor, in both argument orders, with ``TypeError`` "Comparing a DTensor to a non-DTensor is
ambiguous"; two DTensors with other placements fail with "DTensor placements do not match"; two
with the same placements compare their local shards. The same holds for our DTensors, on
PyTorch's meshes and on HyperParallel's, with ``torch.testing._internal.common_utils`` imported
before or after ``hyper_parallel``.
"""
import subprocess
import sys

import pytest
import torch

MIXED = "Comparing a DTensor to a non-DTensor is ambiguous"


def _mixed_body(hp_mesh):
    import torch.distributed as dist
    from torch.testing._internal.common_utils import TestCase

    import hyper_parallel as hp
    from hyper_parallel import Replicate, Shard
    from hyper_parallel.device_mesh import init_device_mesh as torch_style_mesh

    ws = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (ws,)) if hp_mesh else torch_style_mesh("cpu", (ws,))
    full = torch.arange(4.0 * ws).reshape(2 * ws, 2)
    a = hp.distribute_tensor(full, mesh, [Shard(0)])
    r = hp.distribute_tensor(full, mesh, [Replicate()])
    tc = TestCase()
    seen = []
    for plain in (full, a.to_local(), r.to_local(), full[0, 0].clone(), 1.0, [1.0, 2.0]):
        for check in (torch.testing.assert_close, tc.assertEqual):
            for x, y in ((a, plain), (plain, a), (r, plain), (plain, r)):
                with pytest.raises(TypeError, match=MIXED):
                    check(x, y)
                seen.append(1)
    # then the placements, then the values
    for check in (torch.testing.assert_close, tc.assertEqual):
        with pytest.raises(AssertionError, match="DTensor placements do not match"):
            check(a, r)
        with pytest.raises(AssertionError, match="DTensor placements do not match"):
            check(r, a)
        check(a, hp.distribute_tensor(full.clone(), mesh, [Shard(0)]))
        with pytest.raises(AssertionError):
            check(a, hp.distribute_tensor(full + 1, mesh, [Shard(0)]))
        # the explicit comparisons the message suggests
        check(a.full_tensor(), full)
        check(full, a.full_tensor())
        check(a.to_local(), full.chunk(ws)[dist.get_rank()])
    return len(seen)


@pytest.mark.parametrize("hp_mesh", [False, True])
def test_dtensor_vs_plain_tensor_is_a_type_error(dist_runner, hp_mesh):
    assert dist_runner.run(2, _mixed_body, hp_mesh) == [6 * 2 * 4] * 2


def test_common_utils_imported_first():
    """common_utils binds the function at its import: the hook rebinds it there too."""
    code = (
        "import torch\n"
        "from torch.testing._internal.common_utils import TestCase\n"
        "import hyper_parallel as hp\n"
        "import torch.distributed as dist\n"
        "from hyper_parallel import DeviceMesh, Replicate\n"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=2)\n"
        "mesh = DeviceMesh('cpu', [0, 1])\n"
        "d = hp.distribute_tensor(torch.ones(2, 2), mesh, [Replicate()])\n"
        "for x, y in ((d, torch.ones(2, 2)), (torch.ones(2, 2), d)):\n"
        "    try:\n"
        "        TestCase().assertEqual(x, y)\n"
        "    except TypeError as e:\n"
        "        assert 'Comparing a DTensor to a non-DTensor is ambiguous' in str(e), e\n"
        "    else:\n"
        "        raise SystemExit('no TypeError')\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
