#!/usr/bin/env python3
"""Which collected tests are EXCLUDED (poke torch internals / torch-only harness), and why.

python excluded.py --deselect FILE   -> prints --deselect args for pytest (ids relative to the variant dir)
python excluded.py --list            -> prints the table
"""
import re
import sys

LOCAL = "LocalTensor variant: single-process torch LocalTensorMode simulation (torch-internal harness, not a user program)"
# (file, class regex, test regex, reason)
RULES = [
    (r".*", r".*WithLocalTensor$", r".*", LOCAL),
    # test_dtensor.py
    ("test_dtensor.py", "DTensorTest$", "test_dtensor_constructor$", "builds DTensor from DTensorSpec/TensorMeta (torch internal)"),
    ("test_dtensor.py", "DTensorTest$", "test_to_local$", "builds DTensor from DTensorSpec/TensorMeta (torch internal)"),
    ("test_dtensor.py", "DTensorTest$", "test_dtensor_spec_hash$", "hashes dtensor._spec (DTensorSpec internal)"),
    ("test_dtensor.py", "DTensorTest$", "test_shard_tensor(_2d)?$", "torch.distributed.tensor._api._shard_tensor (private)"),
    ("test_dtensor.py", "DTensorTest$", "test_dtensor_async_output$", "asserts the result type is funcol AsyncCollectiveTensor (private torch._functional_collectives type)"),
    ("test_dtensor.py", "DTensorMeshTest$", "test_dtensor_spec_local_shard_offset$", "torch.distributed.tensor._utils.compute_local_shape_and_global_offset (private, function-level import)"),
    ("test_dtensor.py", "TestDTensorPlacementTypes$", ".*", "Shard._split_tensor + _collective_utils.unpad_tensor (private)"),
    ("test_dtensor.py", "TestDTensorSpec$", ".*", "DTensorSpec / ShardOrderEntry internals"),
    # test_redistribute.py
    ("test_redistribute.py", "RedistributeTest$", "test_all_gather_.*", "traces aten ops with torch.utils._debug_mode.DebugMode (private)"),
    ("test_redistribute.py", "RedistributeTest$", "test_replicate_to_partial$", "private torch.distributed.tensor._redistribute.Redistribute.apply"),
    ("test_redistribute.py", "RedistributeTest$", "test_shard_dim_alltoall_.*", "private _collective_utils.shard_dim_alltoall"),
    ("test_redistribute.py", "DistributeWithDeviceOrderTest$", ".*", "ShardOrderEntry / _StridedShard / DTensorSpec / redistribute_cost / DebugMode internals"),
    ("test_redistribute.py", "TransformInfoTest$", ".*", "private _TransformInfo"),
    ("test_redistribute.py", "OptimizeFlattenedReductionsTest$", ".*", "private _optimize_transform_infos / _FlattenedTransformInfo"),
    ("test_redistribute.py", "MultiDimRedistributeOptimizationTest$", ".*", "private DeviceMesh._flatten + torch's flattened-collective optimisation"),
    ("test_redistribute.py", "FlattenedReductionIntegrationTest$", ".*", "private DeviceMesh._flatten + torch's flattened-collective optimisation"),
]


def reason(test_id):
    """test_id like 'parallel/test_tp_style.py::Class::test_x' -> reason or None."""
    f, cls, name = test_id.split("::")
    for rf, rc, rt, why in RULES:
        if re.fullmatch(rf, f) and re.search(rc, cls) and re.match(rt, name):
            return why
    return None


if __name__ == "__main__":
    if sys.argv[1] == "--deselect":
        f = sys.argv[2]
        import subprocess
        ids = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", f],
                             capture_output=True, text=True).stdout.split()
        print(" ".join(f"--deselect {i}" for i in ids if "::" in i and reason(i)))
