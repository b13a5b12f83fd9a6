"""Start replica groups of ``examples/llama/train.py --ft-*`` as real processes (tests only).

Each group is its own ``torch.distributed`` job (its own free ``MASTER_PORT`` on 127.0.0.1); each
rank is started directly (``RANK``/``WORLD_SIZE``/``MASTER_*``, as torchrun would set them) so the
test holds every process id, can SIGKILL a whole group, and kills only what it started.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from hyper_parallel.ft.lighthouse import free_port

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "llama" / "train.py"


class Group:
    """The processes of one replica group; ``log`` is its rank-0 JSON-lines step log."""

    def __init__(self, group_id: int, ranks: int, lighthouse: str, log: Path, argv: List[str],
                 env: Optional[Dict[str, str]] = None, out_dir: Optional[Path] = None):
        self.group_id, self.log = group_id, Path(log)
        port = free_port()
        self.procs = []
        self.outputs = []
        for rank in range(ranks):
            penv = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank),
                        WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), PYTHONPATH=str(ROOT), **(env or {}))
            out = Path(out_dir or self.log.parent) / f"{self.log.stem}.rank{rank}.out"
            self.outputs.append(out)
            cmd = [sys.executable, str(TRAIN), *argv, "--ft-replica-group-id", str(group_id),
                   "--ft-lighthouse", lighthouse, "--ft-log", str(self.log)]
            self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=penv, stdout=open(out, "wb"),
                                               stderr=subprocess.STDOUT))

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def kill(self) -> None:
        """SIGKILL every process of this group that is still running."""
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def wait(self, deadline: float) -> List[int]:
        """Wait until every rank exits or ``deadline`` (time.monotonic()) passes (then kill the group and raise)."""
        for p in self.procs:
            left = deadline - time.monotonic()
            try:
                p.wait(max(0.1, left))
            except subprocess.TimeoutExpired:
                self.kill()
                raise TimeoutError(f"replica group {self.group_id} did not finish in time; output:\n{self.output()}")
        return [p.returncode for p in self.procs]

    def output(self) -> str:
        return "\n".join(f"--- {o.name}\n" + o.read_text(errors="replace")[-3000:] for o in self.outputs if o.exists())

    def records(self, rank: int = 0) -> List[dict]:
        path = self.log if rank == 0 else Path(f"{self.log}.rank{rank}")
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def committed(records: List[dict]) -> List[dict]:
    return [r for r in records if r["committed"]]


def reference_losses(config: str, steps: int) -> List[float]:
    """Per-step losses of one process training ``config``'s global batches (what 2 uninterrupted groups equal)."""
    from examples.llama.configs import get_config
    from examples.llama.reference import train_reference
    cfg = get_config(config)
    losses, _ = train_reference(cfg.model, steps, seed=cfg.seed, global_batch=cfg.global_batch,
                                seq_len=cfg.seq_len, optim=cfg.optim)
    return losses
