"""Multi-process test harness: real torch.distributed (gloo, CPU) worker pools.

Usage from a test module (``fn`` must be a module-level function so that it
pickles by reference; workers import the test module by name)::

    import torch
    import torch.distributed as dist

    def _allreduce_body(scale):
        t = torch.tensor([float(dist.get_rank())]) * scale
        dist.all_reduce(t)
        return t.item()

    def test_allreduce(dist_runner):
        out = dist_runner.run(4, _allreduce_body, 2.0)   # one value per rank
        assert out == [12.0] * 4

or without the fixture: ``run_distributed(4, _allreduce_body, 2.0)``.

Design
------
* One persistent pool of ``world_size`` processes per world size, started
  lazily with the ``spawn`` start method and reused for the whole pytest
  session.  Each worker sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT,
  ``torch.set_num_threads(1)`` and joins a gloo process group over
  ``tcp://127.0.0.1:<free port>``; then it loops: receive task, run it, send
  the result, run the cleanup hook (``hyper_parallel.dispatch.modes.reset_process_state()`` if the
  package is loaded and defines it).
* Parent <-> rank communication is one ``multiprocessing.Pipe`` per rank with
  plain ``pickle`` (tensors travel by value).  The parent waits on the pipes
  *and* on the process sentinels, so a worker that dies (segfault,
  ``os._exit``) is noticed immediately.
* Any failure (exception on a rank, a dead rank, a timeout, an interrupt of the
  parent) kills the whole pool; the next task on that world size starts a
  fresh one.  After the first failure the other ranks get ``HP_TEST_FAIL_GRACE``
  seconds to finish (they are usually blocked in a collective); stragglers get
  their Python stacks dumped (faulthandler) into the error message and are
  killed.

Environment variables
---------------------
HP_TEST_PG_TIMEOUT       gloo process-group timeout in seconds (default 60)
HP_TEST_FAIL_GRACE       seconds to wait for the other ranks after a failure (3)
HP_TEST_STARTUP_TIMEOUT  seconds allowed for a pool to start (default 180)
HP_TEST_MAX_WORLD_SIZE   larger world sizes are skipped (default 8)
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait as mp_wait
import multiprocessing as mp
from typing import Any, Callable

__all__ = [
    "DistributedTestError",
    "DistributedTimeoutError",
    "WorkerPool",
    "get_pool",
    "run_distributed",
    "shutdown_all_pools",
    "max_world_size",
    "requires_world_size",
    "PG_TIMEOUT",
    "FAIL_GRACE",
]


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return float(default)


PG_TIMEOUT = _env_float("HP_TEST_PG_TIMEOUT", 60)
FAIL_GRACE = _env_float("HP_TEST_FAIL_GRACE", 3)
STARTUP_TIMEOUT = _env_float("HP_TEST_STARTUP_TIMEOUT", 180)

_STOP = b"__hp_stop__"
_STACK_DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)


def max_world_size() -> int:
    return int(_env_float("HP_TEST_MAX_WORLD_SIZE", 8))


def requires_world_size(world_size: int):
    """pytest marker: skip unless ``world_size`` <= HP_TEST_MAX_WORLD_SIZE."""
    import pytest

    limit = max_world_size()
    return pytest.mark.skipif(
        world_size > limit,
        reason=f"needs world_size={world_size} > HP_TEST_MAX_WORLD_SIZE={limit}")


class DistributedTestError(AssertionError):
    """A distributed task failed on at least one rank (or a rank died)."""


class DistributedTimeoutError(DistributedTestError):
    """A distributed task did not finish on every rank within its timeout."""


# --------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parent_watchdog(parent_pid: int) -> None:
    # If the pytest process disappears (SIGKILL, crash) while this worker is
    # blocked in a collective, nobody would ever kill us: exit on our own.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def _run_cleanup_hook() -> None:
    """Reset package-global state between tasks (only if the package is loaded)."""
    # Only if a task imported the package: importing it here would make every
    # test (including the harness's own) depend on the package importing cleanly.
    if "hyper_parallel" not in sys.modules:
        return
    try:
        from hyper_parallel.dispatch.modes import reset_process_state
    except ImportError:
        return
    reset_process_state()  # errors here are reported as a failure of the task


def _send(conn: Connection, obj: Any) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _worker_main(rank: int, world_size: int, port: int, conn: Connection,
                 stack_file: str, parent_pid: int, pg_timeout: float) -> None:
    # Ctrl-C goes to the whole process group; the parent cleans us up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_parent_watchdog, args=(parent_pid,), daemon=True).start()
    stack_fh = open(stack_file, "w")
    if _STACK_DUMP_SIGNAL is not None:
        faulthandler.register(_STACK_DUMP_SIGNAL, file=stack_fh, all_threads=True)
    try:
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
        sys.stderr.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    except Exception:
        pass

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=timedelta(seconds=pg_timeout),
        )
    except BaseException:
        _send(conn, ("init_error", traceback.format_exc()))
        return
    _send(conn, ("ready", os.getpid()))

    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if msg == _STOP:
            break
        try:
            fn, args, kwargs = pickle.loads(msg)
            value = fn(*args, **kwargs)
            reply = ("ok", pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        except BaseException:
            reply = ("error", traceback.format_exc())
        try:
            _run_cleanup_hook()
        except BaseException:
            if reply[0] == "ok":
                reply = ("error", "hyper_parallel.dispatch.modes.reset_process_state() failed after the task:\n"
                         + traceback.format_exc())
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
        try:
            _send(conn, reply)
        except (EOFError, OSError):
            break

    try:
        dist.destroy_process_group()
    except Exception:
        pass
    conn.close()


# --------------------------------------------------------------------------
# parent side
# --------------------------------------------------------------------------

def _indent(text: str, prefix: str = "    ") -> str:
    return "".join(prefix + line if line.strip() else line
                   for line in text.rstrip().splitlines(True))


class WorkerPool:
    """``world_size`` spawned worker processes sharing one gloo process group."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self.pids: list[int] = []
        self.port: int | None = None
        self.alive = False
        self._tmpdir: tempfile.TemporaryDirectory | None = None
        self.startup_seconds: float | None = None

    # -- lifecycle ---------------------------------------------------------
    def _stack_file(self, rank: int) -> str:
        assert self._tmpdir is not None
        return os.path.join(self._tmpdir.name, f"stack_rank{rank}.txt")

    def start(self, attempts: int = 3) -> "WorkerPool":
        t0 = time.monotonic()
        last_error = ""
        for _ in range(attempts):
            try:
                self._start_once()
                self.startup_seconds = time.monotonic() - t0
                return self
            except _PoolStartError as exc:
                last_error = str(exc)
                self.kill()
            except BaseException:
                self.kill()
                raise
        raise DistributedTestError(
            f"could not start a gloo worker pool of world_size={self.world_size} "
            f"after {attempts} attempts:\n{last_error}")

    def _start_once(self) -> None:
        ctx = mp.get_context("spawn")
        self._tmpdir = tempfile.TemporaryDirectory(prefix=f"hp_pool{self.world_size}_")
        self.port = _free_port()
        self.procs, self.conns, self.pids = [], [], []
        with _no_main_module_in_children():
            self._spawn_workers(ctx)
        self.alive = True
        self._wait_ready()

    def _spawn_workers(self, ctx) -> None:
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            p = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, self.port, child_conn,
                      self._stack_file(rank), os.getpid(), PG_TIMEOUT),
                name=f"hp-worker-ws{self.world_size}-r{rank}",
                daemon=False,
            )
            p.start()
            child_conn.close()
            self.procs.append(p)
            self.conns.append(parent_conn)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        pending = set(range(self.world_size))
        pids: dict[int, int] = {}
        errors: dict[int, str] = {}
        while pending and not errors:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _PoolStartError(
                    f"ranks {sorted(pending)} did not initialise within {STARTUP_TIMEOUT:.0f}s")
            waitables = {self.conns[r]: r for r in pending}
            waitables.update({self.procs[r].sentinel: r for r in pending})
            for obj in mp_wait(list(waitables), timeout=remaining):
                r = waitables[obj]
                if r not in pending:
                    continue
                msg = self._try_recv(r)
                if msg is None:
                    if not self.procs[r].is_alive() or obj is self.conns[r]:
                        self.procs[r].join(0.5)
                        errors[r] = (f"rank {r} died during start-up "
                                     f"(exit code {self.procs[r].exitcode})")
                        pending.discard(r)
                    continue
                pending.discard(r)
                if msg[0] == "ready":
                    pids[r] = msg[1]
                else:
                    errors[r] = f"rank {r} failed to initialise:\n{_indent(msg[1])}"
        if errors:
            raise _PoolStartError("\n".join(errors[r] for r in sorted(errors)))
        self.pids = [pids[r] for r in range(self.world_size)]

    def _try_recv(self, rank: int):
        conn = self.conns[rank]
        try:
            if not conn.poll(0):
                return None
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return None

    def is_healthy(self) -> bool:
        return self.alive and all(p.is_alive() for p in self.procs)

    def request_stop(self) -> None:
        if self.alive:
            for conn in self.conns:
                try:
                    conn.send_bytes(_STOP)
                except (OSError, ValueError):
                    pass

    def shutdown(self, timeout: float = 5.0) -> None:
        """Graceful stop (STOP message, destroy_process_group), then kill."""
        self.request_stop()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Terminate every worker right away (SIGTERM, then SIGKILL)."""
        self.alive = False
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 2.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for conn in self.conns:
            try:
                conn.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.close()
            except ValueError:
                pass
        self.procs, self.conns = [], []
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def _dump_stacks(self, ranks) -> dict[int, str]:
        """Python stacks of (stuck) ranks via faulthandler; best effort."""
        if _STACK_DUMP_SIGNAL is None or not ranks:
            return {}
        sizes = {}
        for r in ranks:
            try:
                sizes[r] = os.path.getsize(self._stack_file(r))
                os.kill(self.procs[r].pid, _STACK_DUMP_SIGNAL)
            except (OSError, ValueError, TypeError):
                pass
        time.sleep(0.3)
        stacks = {}
        for r, start in sizes.items():
            try:
                with open(self._stack_file(r)) as fh:
                    fh.seek(start)
                    text = fh.read().strip()
                # drop the harness's own watchdog thread from the dump
                blocks = [b for b in text.split("\n\n") if "_parent_watchdog" not in b]
                text = "\n\n".join(blocks).strip()
                if text:
                    stacks[r] = text
            except OSError:
                pass
        return stacks

    # -- tasks -------------------------------------------------------------
    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list:
        try:
            payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(
                f"run_distributed: cannot pickle the task ({exc!r}). `fn` must be a "
                "module-level function (no lambdas/closures/locals) and its arguments "
                "must be picklable.") from exc

        n = self.world_size
        name = getattr(fn, "__module__", "?") + "." + getattr(fn, "__qualname__", repr(fn))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        died: dict[int, str] = {}
        pending = set(range(n))
        start = time.monotonic()
        deadline = start + timeout
        fail_deadline: float | None = None
        try:
            for r in range(n):
                try:
                    self.conns[r].send_bytes(payload)
                except (OSError, ValueError) as exc:
                    died[r] = f"rank {r} could not receive the task ({exc!r}); worker dead?"
                    pending.discard(r)
                    fail_deadline = fail_deadline or time.monotonic() + FAIL_GRACE

            while pending:
                now = time.monotonic()
                until = deadline if fail_deadline is None else min(deadline, fail_deadline)
                if now >= until:
                    break
                waitables = {self.conns[r]: r for r in pending}
                waitables.update({self.procs[r].sentinel: r for r in pending})
                ready = mp_wait(list(waitables), timeout=until - now)
                # handle pipes before sentinels: a rank may reply and then exit
                ready.sort(key=lambda o: 0 if isinstance(o, Connection) else 1)
                for obj in ready:
                    r = waitables[obj]
                    if r not in pending:
                        continue
                    msg = self._try_recv(r)
                    if msg is None:
                        if isinstance(obj, Connection) or not self.procs[r].is_alive():
                            self.procs[r].join(0.5)
                            code = self.procs[r].exitcode
                            how = (f"killed by signal {-code}" if code is not None and code < 0
                                   else f"exit code {code}")
                            died[r] = f"rank {r} died ({how}) while running {name}"
                            pending.discard(r)
                            if fail_deadline is None:
                                fail_deadline = time.monotonic() + FAIL_GRACE
                        continue
                    pending.discard(r)
                    status, data = msg
                    if status == "ok":
                        results[r] = data
                    else:
                        errors[r] = data
                        if fail_deadline is None:
                            fail_deadline = time.monotonic() + FAIL_GRACE
        except BaseException:
            # interrupted (Ctrl-C, pytest-timeout, ...): the pool is mid-task
            self.kill()
            raise

        if not pending and not errors and not died:
            out = []
            for r in range(n):
                try:
                    out.append(pickle.loads(results[r]))
                except Exception as exc:
                    raise DistributedTestError(
                        f"{name}: cannot unpickle the return value of rank {r}: {exc!r}") from exc
            return out

        # failure: collect diagnostics, kill the pool, raise
        stuck = sorted(pending)
        stacks = self._dump_stacks(stuck)
        self.kill()
        elapsed = time.monotonic() - start
        timed_out = bool(stuck) and not errors and not died
        lines = []
        if timed_out:
            lines.append(f"{name} timed out after {elapsed:.1f}s (timeout={timeout}s) on "
                         f"world_size={n}; ranks {stuck} did not finish "
                         f"(finished: {sorted(results)}). The pool was killed.")
        else:
            failed = sorted(set(errors) | set(died))
            lines.append(f"{name} failed on world_size={n}: ranks {failed} failed"
                         + (f", ranks {stuck} did not finish" if stuck else "")
                         + ". The pool was killed.")
        for r in range(n):  # the failures first, then the stragglers
            if r in errors:
                lines.append(f"\n--- rank {r} raised ---\n{_indent(errors[r])}")
            elif r in died:
                lines.append(f"\n--- {died[r]} ---")
        for r in range(n):
            if r in pending:
                why = ("timeout" if timed_out else
                       f"within {FAIL_GRACE:g}s after the first failure")
                lines.append(f"\n--- rank {r} did not finish ({why}); stack when killed ---\n"
                             + _indent(stacks.get(r, "<no stack available>")))
        cls = DistributedTimeoutError if timed_out else DistributedTestError
        raise cls("\n".join(lines))


class _PoolStartError(Exception):
    pass


class _no_main_module_in_children:
    """Spawned workers must not re-import the parent's ``__main__``.

    multiprocessing's spawn re-runs the main script (``pytest`` console
    script, an ad-hoc driver without a ``__main__`` guard, ...) in every child;
    the workers only need ``tests.harness`` and the test modules, so the
    main-module fixup is dropped from the preparation data while starting.
    """

    def __enter__(self):
        import multiprocessing.spawn as mp_spawn

        self._mod = mp_spawn
        self._orig = orig = mp_spawn.get_preparation_data

        def get_preparation_data(name):
            data = orig(name)
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
            return data

        mp_spawn.get_preparation_data = get_preparation_data
        return self

    def __exit__(self, *exc):
        self._mod.get_preparation_data = self._orig
        return False


_POOLS: dict[int, WorkerPool] = {}


def get_pool(world_size: int) -> WorkerPool:
    """The live pool for ``world_size`` (started on first use, restarted if dead)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    pool = _POOLS.get(world_size)
    if pool is not None and not pool.is_healthy():
        pool.kill()
        pool = None
    if pool is None:
        pool = WorkerPool(world_size).start()
        _POOLS[world_size] = pool
    return pool


def run_distributed(world_size: int, fn: Callable, *args: Any, timeout: float = 120,
                    **kwargs: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of a ``world_size`` gloo group.

    Returns the per-rank return values (index = rank).  Raises
    :class:`DistributedTestError` (an ``AssertionError``) with every failing
    rank's traceback if any rank raised or died, and
    :class:`DistributedTimeoutError` if the task exceeded ``timeout`` seconds.
    """
    pool = get_pool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    finally:
        if not pool.alive:
            _POOLS.pop(world_size, None)


def shutdown_all_pools(timeout: float = 1.0) -> None:
    """Stop every pool (all at once), killing workers that do not exit in time."""
    pools = list(_POOLS.values())
    _POOLS.clear()
    for pool in pools:
        pool.request_stop()
    deadline = time.monotonic() + timeout
    for pool in pools:
        for p in pool.procs:
            try:
                p.join(max(0.0, deadline - time.monotonic()))
            except (AssertionError, ValueError):
                pass
    for pool in pools:
        pool.kill()


atexit.register(shutdown_all_pools)
