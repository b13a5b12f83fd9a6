"""A two-node launch of the example trainer: two torchrun agents on this machine (issue 26, item 5).

    torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 2 --rdzv-backend c10d
             --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID examples/llama/train.py --dp 2 --tp 2 ...

Both agents must exit 0; rank 0 reports which node holds each rank (torchrun numbers ranks node
by node) and that each tp group lies within one node, and the loss curve matches the
single-process run (the trainer's own comparison).
"""
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from examples.llama.plot import read_loss_csv

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_agent_launch_of_the_trainer(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HP_TEST_KILL_AT_STEP")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    port = _free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", f"hp-multinode-{port}", str(ROOT / "examples/llama/train.py"),
               "--dp", "2", "--tp", "2", "--config", "tiny", "--steps", "3", "--out", str(tmp_path / "loss")]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=TIMEOUT)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"the two-agent launch did not finish within {TIMEOUT}s")
    for node, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"agent {node} exited with {p.returncode}:\n{out[-6000:]}"
    out = "\n".join(outs)
    # rank 0 may be on either agent: c10d rendezvous numbers the agents in the order they join
    m = re.search(r"multi-node: 2 nodes x 2 processes, node of each rank \[(\d), (\d), (\d), (\d)\]; "
                  r"innermost mesh dim 'tp' groups \[\[0, 1\], \[2, 3\]\] each within one node: yes", out)
    assert m, out[-6000:]
    nodes = [int(g) for g in m.groups()]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3], nodes
    m = re.search(r"largest loss difference vs single process: (\S+) \(relative (\S+)\)", out)
    assert m and float(m.group(1)) < 1e-4 and float(m.group(2)) < 1e-4, out[-6000:]
    series = read_loss_csv(tmp_path / "loss.csv")
    assert len(series["dp2_tp2"]) == 3 and len(series["single_process"]) == 3
