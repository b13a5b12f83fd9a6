"""The torchft lighthouse: start the real ``torchft_lighthouse`` binary, check that one is reachable.

The lighthouse is torchft's quorum server (a Rust binary shipped in the ``torchft`` wheel). Every
replica group's rank 0 heartbeats to it and asks it for a quorum each step; it decides which groups
take part and which group heals from which. One lighthouse serves a whole job; it holds no model
state, so restarting it costs one quorum.

``min_replicas`` (the fewest groups that may form a quorum): the default here is a *majority* of the
job's groups (``n // 2 + 1``), so no minority of groups can ever train on its own: a group that
restarts while the others are busy cannot form a quorum alone and step from its stale state (split
brain). With two groups a majority is both; to keep training on one survivor pass
``min_replicas=1`` explicitly; then :class:`hyper_parallel.ft.optimizer.FTOptimizer` still refuses
to commit a step that a group takes alone before it has ever stepped with a peer (a restarted group
heals first). docs/fault_tolerance.md, "Replica groups".
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional


def majority(num_replica_groups: int) -> int:
    """The smallest number of groups that no other disjoint set of groups can also reach."""
    if not isinstance(num_replica_groups, int) or num_replica_groups < 1:
        raise ValueError(f"num_replica_groups must be an int >= 1, got {num_replica_groups!r}")
    return num_replica_groups // 2 + 1


def lighthouse_binary() -> str:
    """Path of ``torchft_lighthouse`` (next to this interpreter, else on PATH)."""
    here = Path(sys.executable).parent / "torchft_lighthouse"
    if here.exists():
        return str(here)
    found = shutil.which("torchft_lighthouse")
    if found is None:
        raise FileNotFoundError("torchft_lighthouse not found next to the Python interpreter nor on PATH; "
                                "install torchft (pip install torchft==0.2.0, in the test extra)")
    return found


def split_address(addr: str) -> tuple:
    """``http://HOST:PORT`` or ``HOST:PORT`` -> ``(host, port)``; a clear error for anything else."""
    if not isinstance(addr, str) or not addr:
        raise ValueError(f"lighthouse address must be a string 'HOST:PORT' or 'http://HOST:PORT', got {addr!r}")
    rest = addr.split("://", 1)[1] if "://" in addr else addr
    host, sep, port = rest.rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"lighthouse address {addr!r}: expected 'HOST:PORT' or 'http://HOST:PORT'")
    return host, int(port)


def check_reachable(addr: str, timeout_s: float = 5.0) -> str:
    """Raise ``ConnectionError`` naming ``addr`` unless a TCP connection to it opens within ``timeout_s``.

    Returns the address in torchft's form (``http://HOST:PORT``). torchft's own client would retry
    for its whole connect timeout and, on the group's other ranks, wait on the store without end;
    this check fails fast and alike on every rank, before any collective.
    """
    host, port = split_address(addr)
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic())):
                return f"http://{host}:{port}"
        except OSError as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise ConnectionError(f"no torchft lighthouse reachable at {addr!r} within {timeout_s:g} s ({last}); "
                                  "start one with `torchft_lighthouse --bind HOST:PORT --min_replicas N` "
                                  "(scripts/ft_demo.sh) and pass its address")
        time.sleep(0.1)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class Lighthouse:
    """A ``torchft_lighthouse`` process on a free loopback port (tests, the demo script).

    ``with Lighthouse(min_replicas=1) as lh: ... lh.address`` starts it, waits until it accepts
    connections, and stops it (SIGTERM, then SIGKILL) on exit: only the process it started.
    ``heartbeat_timeout_ms`` is how long a silent group stays in the quorum (time to detect a dead
    group); ``quorum_tick_ms`` how often the lighthouse re-evaluates; ``join_timeout_ms`` how long a
    quorum waits for the groups of the previous one.
    """

    def __init__(self, min_replicas: int, *, host: str = "127.0.0.1", port: Optional[int] = None,
                 quorum_tick_ms: int = 100, join_timeout_ms: int = 10000, heartbeat_timeout_ms: int = 5000,
                 log_path: Optional[str] = None):
        if not isinstance(min_replicas, int) or min_replicas < 1:
            raise ValueError(f"Lighthouse: min_replicas must be an int >= 1, got {min_replicas!r}")
        self.min_replicas = min_replicas
        self.host, self.port = host, port or free_port(host)
        self.args = ["--bind", f"{host}:{self.port}", "--min_replicas", str(min_replicas),
                     "--quorum_tick_ms", str(quorum_tick_ms), "--join_timeout_ms", str(join_timeout_ms),
                     "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)]
        self.log_path = log_path
        self.proc = None

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 120.0) -> "Lighthouse":
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "info"))
        self.proc = subprocess.Popen([lighthouse_binary(), *self.args], stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"torchft_lighthouse exited with {self.proc.returncode} at start "
                                   f"(args {self.args}; log {self.log_path})")
            try:
                check_reachable(self.address, timeout_s=0.2)
                return self
            except ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def __enter__(self) -> "Lighthouse":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
