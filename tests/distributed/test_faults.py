"""Dead and hung peers end the job with a message naming the collective (docs/fault_tolerance.md).

Each test launches its own processes (``multiprocessing`` fork of the test process with the
library already imported, gloo over TCP; the shared
worker pool cannot lose a rank), lets one rank die (``SIGKILL`` from inside a step), raise, or
hang, and checks that every survivor raises ``CollectiveError`` naming the collective (and the mesh
dim / peer where known), exits non-zero, and does so within a bound: a dead peer is seen by its
neighbours as soon as they read from its socket, a hung one at the collective timeout. The
processes' own gloo timeout is 60 s and every launch is killed after ``LAUNCH_LIMIT`` s, so
nothing here can reach the suite's pool timeout. Measured detection times are printed.

Covered: eager TP (row-parallel all_reduce), FSDP (async all_gather / reduce_scatter),
the deferred (pending Partial) gradient all_reduce, cross-mesh point-to-point, pipeline
point-to-point (``ScheduleGPipe``), a rank raising inside forward, a hung peer against a 3 s
``set_collective_timeout``; plus the bad-input cases: a truncated checkpoint shard, a checkpoint
of a different model, meshes that do not fit the world.
"""
from __future__ import annotations

import glob
import os
import signal
import socket
import sys
import time
import traceback

import pytest
import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH_LIMIT = 120.0     # a launch is killed after this long (never reached when detection works)
DETECT_BOUND = 20.0      # dead peer -> survivor raised, seconds (measured: well under 1 s idle)
PG_TIMEOUT = 60.0        # the launched processes' default-group timeout


# ------------------------------------------------------------------ launcher

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die(tmp):
    """SIGKILL this process, after noting the time (for the detection time)."""
    with open(os.path.join(tmp, "killed_at"), "w") as fh:
        fh.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def _worker(rank, world, port, tmp, scenario, env):
    import datetime
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    out = os.path.join(tmp, f"rank{rank}.txt")
    try:
        scenario(rank, tmp)
        try:  # rank 0 hosts the store: leave together (a peer already gone makes this fail at once)
            dist.barrier()
        except RuntimeError:
            pass
        with open(out, "w") as fh:
            fh.write(f"ok\n{time.time()!r}\n")
        code = 0
    except BaseException as exc:  # noqa: BLE001 - the report is the point
        with open(out, "w") as fh:
            fh.write(f"raised\n{time.time()!r}\n{type(exc).__module__}.{type(exc).__name__}\n"
                     f"{getattr(exc, 'reason', '')}\n{exc}\n---\n{traceback.format_exc()}")
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown: a survivor leaves as a crashed job would (its sockets close)


def launch(world, scenario, tmp, env=None):
    """Run ``scenario(rank, tmp)`` on ``world`` fresh processes; returns (exit codes, reports, killed_at, wall)."""
    import multiprocessing as mp
    import hyper_parallel  # noqa: F401  (imported once here: the forked ranks start in a second, not ten)
    ctx = mp.get_context("fork")
    port = _free_port()
    env = dict(env or {})
    procs = [ctx.Process(target=_worker, args=(r, world, port, str(tmp), scenario, env)) for r in range(world)]
    for p in procs:
        p.start()
    t0 = time.time()
    deadline = time.monotonic() + LAUNCH_LIMIT
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not hung, f"ranks {hung} still running after {LAUNCH_LIMIT}s: a hang the library should have ended"
    reports = {}
    for r in range(world):
        f = os.path.join(tmp, f"rank{r}.txt")
        if os.path.exists(f):
            lines = open(f).read().split("\n")
            reports[r] = dict(status=lines[0], t=float(lines[1]),
                              type=lines[2] if len(lines) > 2 else "", reason=lines[3] if len(lines) > 3 else "",
                              msg="\n".join(lines[4:]) if len(lines) > 4 else "")
    killed = os.path.join(tmp, "killed_at")
    killed_at = float(open(killed).read()) if os.path.exists(killed) else None
    return [p.exitcode for p in procs], reports, killed_at, time.time() - t0


def _assert_survivors(codes, reports, killed_at, dead, *, op, where=None, reason="peer closed",
                      bound=DETECT_BOUND, t_ref=None):
    """Every rank but ``dead`` raised CollectiveError naming ``op`` (and ``where``), exit code 1, in time."""
    times = []
    for r, code in enumerate(codes):
        if r in dead:
            continue
        rep = reports.get(r)
        assert rep is not None, f"rank {r} left no report (exit code {code})"
        assert code == 1 and rep["status"] == "raised", (r, code, rep)
        assert rep["type"].endswith("CollectiveError"), rep["msg"]
        head = rep["msg"].split("\n---\n")[0]
        assert op in head, f"rank {r}: {op!r} not in {head!r}"
        if where is not None:
            assert where in head, f"rank {r}: {where!r} not in {head!r}"
        assert rep["reason"] == reason, (rep["reason"], head)
        t0 = killed_at if t_ref is None else t_ref
        if t0 is not None:
            dt = rep["t"] - t0
            times.append(dt)
            assert dt < bound, f"rank {r} raised {dt:.1f}s after the fault (bound {bound}s)"
    print(f"detection times (s): {[round(t, 3) for t in times]}")
    return times


# ------------------------------------------------------------------ scenarios

def _tp_model():
    import hyper_parallel as hp
    torch.manual_seed(0)
    import torch.distributed as dist
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    hp.parallelize_module(model, mesh, {"0": hp.ColwiseParallel(), "2": hp.RowwiseParallel()})
    return model


def _tp_steps(rank, tmp, fault):
    model = _tp_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = [0]

    import torch.distributed as dist
    last = dist.get_world_size() - 1

    def hook(_m, _inp, _out):  # between the column- and the row-parallel layer: mid-forward
        if rank == last and step[0] == 2:
            fault(tmp)
    model[1].register_forward_hook(hook)
    for step[0] in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step[0]))
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _tp_killed(rank, tmp):
    _tp_steps(rank, tmp, _die)


def _raise_in_forward(tmp):
    raise ValueError("a bug in forward on rank 1")


def _tp_raises(rank, tmp):
    _tp_steps(rank, tmp, _raise_in_forward)


class _DieInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tmp, die):
        ctx.tmp, ctx.die = tmp, die
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.die:
            _die(ctx.tmp)
        return g, None, None


def _fsdp_killed(rank, tmp):
    import hyper_parallel as hp
    torch.manual_seed(0)
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    l1, l2 = nn.Linear(8, 16), nn.Linear(16, 8)
    root = nn.ModuleList([l1, l2])
    hp.fully_shard(l1, mesh=mesh)
    hp.fully_shard(l2, mesh=mesh)
    hp.fully_shard(root, mesh=mesh)
    opt = torch.optim.SGD(root.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        h = _DieInBackward.apply(torch.relu(l1(x)), tmp, rank == 1 and step == 2)  # dies mid-backward
        l2(h).sum().backward()
        opt.step()
        opt.zero_grad()


def _deferred_killed(rank, tmp):
    import hyper_parallel as hp
    from hyper_parallel import Replicate, Shard
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    w = nn.Parameter(hp.distribute_tensor(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), mesh,
                                          [Replicate()]))
    opt = torch.optim.SGD([w], lr=0.1)
    for step in range(3):
        x = hp.distribute_tensor(torch.randn(6, 4, generator=torch.Generator().manual_seed(step)), mesh, [Shard(0)])
        (x @ w).sum().backward()   # w.grad is left Partial: its all_reduce waits for the optimizer step
        if rank == 1 and step == 1:
            _die(tmp)
        opt.step()
        opt.zero_grad()


def _cross_mesh_killed(rank, tmp):
    import hyper_parallel as hp
    from hyper_parallel import Replicate
    a, b = hp.DeviceMesh("cpu", [1]), hp.DeviceMesh("cpu", [0])   # rank 1's stage feeds rank 0's
    for step in range(3):
        x = hp.distribute_tensor(torch.full((4, 4), float(step)), a, [Replicate()])
        if rank == 1 and step == 1:
            _die(tmp)
        y = x.redistribute(b, [Replicate()])
        if rank == 0:
            assert torch.equal(y.to_local(), torch.full((4, 4), float(step)))


def _pipeline_killed(rank, tmp):
    import hyper_parallel as hp
    from hyper_parallel import pipelining as pp
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    step = [0]
    mod = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    if rank == 1:
        def hook(_m, _i, _o):
            if step[0] == 2:
                _die(tmp)
        mod.register_forward_hook(hook)
    stage = pp.PipelineStage(mod, rank, 2, torch.device("cpu"), group=mesh.get_group())
    sched = pp.ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    for step[0] in range(4):
        g = torch.Generator().manual_seed(step[0])
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y)
        opt.step()
        opt.zero_grad()


def _hung_peer(rank, tmp):
    import hyper_parallel as hp
    hp.debug.set_collective_timeout(3)
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    from hyper_parallel import Partial
    p = hp.DTensor.from_local(torch.ones(4), mesh, [Partial()])
    done = os.path.join(tmp, "rank0_done")
    if rank == 1:  # alive but never joins: rank 0 must time out, not hang
        t0 = time.monotonic()
        while not os.path.exists(done) and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        return
    with open(os.path.join(tmp, "started_at"), "w") as fh:
        fh.write(repr(time.time()))
    try:
        p.full_tensor()
    finally:
        open(done, "w").close()


# ------------------------------------------------------------------ tests

def test_sigkill_mid_step_eager_tp(tmp_path):
    codes, reports, killed_at, wall = launch(2, _tp_killed, tmp_path)
    assert codes[1] == -signal.SIGKILL and killed_at is not None
    _assert_survivors(codes, reports, killed_at, {1}, op="all_reduce", where="mesh dim 0 'tp' of mesh (2,)")


def test_sigkill_four_ranks_every_survivor_ends(tmp_path):
    # survivors that were not reading from the dead rank learn it from the next one's exit
    codes, reports, killed_at, wall = launch(4, _tp_killed, tmp_path)
    assert codes[3] == -signal.SIGKILL and killed_at is not None
    _assert_survivors(codes, reports, killed_at, {3}, op="all_reduce", where="mesh dim 0 'tp' of mesh (4,)")


def test_rank_raises_inside_forward(tmp_path):
    codes, reports, _, wall = launch(2, _tp_raises, tmp_path)
    assert codes[1] == 1 and "ValueError" in reports[1]["type"] and "a bug in forward" in reports[1]["msg"]
    # the survivor learns of it when the raising process exits (its sockets close)
    _assert_survivors(codes, reports, reports[1]["t"], {1}, op="all_reduce", where="'tp'")


def test_sigkill_mid_backward_fsdp(tmp_path):
    codes, reports, killed_at, wall = launch(2, _fsdp_killed, tmp_path)
    assert codes[1] == -signal.SIGKILL and killed_at is not None
    _assert_survivors(codes, reports, killed_at, {1}, op="FSDP", where="mesh dim 0 'dp_shard'")


def test_sigkill_before_deferred_gradient_all_reduce(tmp_path):
    codes, reports, killed_at, wall = launch(2, _deferred_killed, tmp_path)
    assert codes[1] == -signal.SIGKILL
    _assert_survivors(codes, reports, killed_at, {1}, op="deferred gradient all_reduce", where="'tp'")


def test_sigkill_cross_mesh_p2p(tmp_path):
    codes, reports, killed_at, wall = launch(2, _cross_mesh_killed, tmp_path)
    assert codes[1] == -signal.SIGKILL
    # "(recv from rank 1)" at the wait, or "(batch_isend_irecv with ranks [1])" when posting already fails
    _assert_survivors(codes, reports, killed_at, {1}, op="cross-mesh p2p (", where="peer rank 1 closed its connection")


def test_sigkill_pipeline_p2p(tmp_path):
    codes, reports, killed_at, wall = launch(2, _pipeline_killed, tmp_path)
    assert codes[1] == -signal.SIGKILL
    _assert_survivors(codes, reports, killed_at, {1}, op="pipeline p2p in ScheduleGPipe.step")


def test_hung_peer_times_out_at_the_collective_timeout(tmp_path):
    codes, reports, _, wall = launch(2, _hung_peer, tmp_path)
    assert codes[1] == 0, reports.get(1)
    started = float(open(os.path.join(tmp_path, "started_at")).read())
    (dt,) = _assert_survivors(codes, reports, None, {1}, op="all_reduce", where="'tp'", reason="timeout",
                              t_ref=started, bound=3 + DETECT_BOUND)
    assert dt >= 2.5, f"raised after {dt:.2f}s, before the 3 s timeout"
    assert "3 s" in reports[0]["msg"] and "HYPER_PARALLEL_COLLECTIVE_TIMEOUT" in reports[0]["msg"]


# ------------------------------------------------------------------ bad input: checkpoints, meshes

def _truncated_and_other_model_body(root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import hyper_parallel as hp
    from hyper_parallel.checkpoint import get_model_state_dict, load
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    hp.parallelize_module(model, mesh, {"0": hp.ColwiseParallel(), "2": hp.RowwiseParallel()})
    path = os.path.join(root, "ck")
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    dist.barrier()
    # a model of another shape and with another layer: every key and shape named, on every rank
    other = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 8))
    hp.parallelize_module(other, mesh, {"0": hp.ColwiseParallel(), "2": hp.RowwiseParallel()})
    with pytest.raises(ValueError) as ei:
        load(get_model_state_dict(other), checkpoint_id=path)
    msg = str(ei.value)
    for part in ("missing from the checkpoint: ['3.weight', '3.bias']", "'0.weight'", "(16, 8)", "(32, 8)",
                 "'2.weight'", "(8, 16)", "(8, 32)"):
        assert part in msg, (part, msg)
    # a truncated shard file: named, on every rank, before any collective
    dist.barrier()
    if dist.get_rank() == 0:
        f = sorted(glob.glob(os.path.join(path, "*.distcp")))[-1]
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)
    dist.barrier()
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as ei:
        load(get_model_state_dict(model), checkpoint_id=path)
    msg = str(ei.value)
    assert "truncated" in msg and ".distcp" in msg and path in msg, msg
    assert time.perf_counter() - t0 < 10
    # a shard file gone
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(sorted(glob.glob(os.path.join(path, "*.distcp")))[0])
    dist.barrier()
    with pytest.raises(FileNotFoundError, match=r"data file .*\.distcp is missing"):
        load(get_model_state_dict(model), checkpoint_id=path)
    return True


def test_truncated_shard_and_other_model_checkpoint(dist_runner, tmp_path):
    assert dist_runner.run(2, _truncated_and_other_model_body, str(tmp_path)) == [True, True]


def _mesh_fit(rank, tmp):
    import hyper_parallel as hp
    from hyper_parallel.device_mesh import init_device_mesh as torch_style
    for init in (hp.init_device_mesh, torch_style):
        with pytest.raises(ValueError, match=r"mesh_shape \(3, 2\) has 6 devices but the world size is 4"):
            init("cpu", (3, 2))
    with pytest.raises(ValueError, match=r"mesh_shape \(3,\) has 3 devices, which does not divide the world size 4"):
        hp.init_device_mesh("cpu", (3,))
    m = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))   # a smaller dividing mesh is valid (HP blocks)
    assert tuple(m.rank_list) == ((0, 1) if rank < 2 else (2, 3)), (rank, m.rank_list)


def test_init_device_mesh_that_does_not_fit_the_world(tmp_path):
    codes, reports, _, _ = launch(4, _mesh_fit, tmp_path)
    assert codes == [0, 0, 0, 0], {r: rep["msg"] for r, rep in reports.items() if rep["status"] != "ok"}


# ------------------------------------------------------------------ configuration

def test_timeout_configuration_and_bad_values(monkeypatch):
    import hyper_parallel as hp
    from hyper_parallel.distributed import collective_errors as faults
    assert faults.DEFAULT_TIMEOUT_S == 600
    try:
        monkeypatch.delenv(faults.TIMEOUT_ENV, raising=False)
        monkeypatch.delenv(faults.LEGACY_TIMEOUT_ENV, raising=False)
        monkeypatch.delenv(faults.CHECK_ENV, raising=False)
        faults.reset()
        assert hp.debug.collective_timeout() == 600 and not hp.debug.check_collectives_enabled()
        monkeypatch.setenv("HYPER_PARALLEL_COLLECTIVE_TIMEOUT", "7.5")
        monkeypatch.setenv("HYPER_PARALLEL_CHECK_COLLECTIVES", "1")
        faults.reset()  # what an import does
        assert hp.debug.collective_timeout() == 7.5 and hp.debug.check_collectives_enabled()
        with hp.debug.check_collectives(False):
            assert not hp.debug.check_collectives_enabled()
        assert hp.debug.check_collectives_enabled()
        monkeypatch.delenv("HYPER_PARALLEL_COLLECTIVE_TIMEOUT")
        monkeypatch.setenv("HYPER_PARALLEL_TIMEOUT", "9")   # the older name is still read
        assert hp.debug.collective_timeout() == 9
        hp.debug.set_collective_timeout(4)                  # the setter wins over the environment
        assert hp.debug.collective_timeout() == 4
        hp.debug.set_collective_timeout(None)
        assert hp.debug.collective_timeout() == 9
        monkeypatch.setenv("HYPER_PARALLEL_COLLECTIVE_TIMEOUT", "soon")
        with pytest.raises(ValueError, match="HYPER_PARALLEL_COLLECTIVE_TIMEOUT='soon'"):
            hp.debug.collective_timeout()
        monkeypatch.setenv("HYPER_PARALLEL_CHECK_COLLECTIVES", "maybe")
        with pytest.raises(ValueError, match="HYPER_PARALLEL_CHECK_COLLECTIVES='maybe'"):
            faults.reset()
        for bad in (0, -1, "x", float("nan"), float("inf"), True):
            with pytest.raises(ValueError, match="set_collective_timeout"):
                hp.debug.set_collective_timeout(bad)
        with pytest.raises(TypeError, match="enabled=1"):
            hp.debug.set_check_collectives(1)
    finally:
        monkeypatch.undo()
        faults.reset()
