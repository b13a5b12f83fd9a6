"""One replica group's ``torchft.Manager``: its cross-group process group, checkpoint transport and checks.

Each rank of a replica group runs one ``Manager`` (torchft's design): rank ``r`` of every group
joins torchft's reconfigurable gloo (or NCCL) process group of "rank r of each group" (the fault-
tolerant replicate dimension), so a group's gradient shard on rank ``r`` is all-reduced with the
same shard of the other groups. Healing uses torchft's ``PGTransport`` over that same process group:
rank ``r`` of the healing group receives rank ``r``'s state from a live group. Both require that
rank ``r`` holds the *same local shard* in every group: the groups must share one inner layout
(:mod:`hyper_parallel.ft.state` checks it when a group heals, and names the first mismatch).

The group's own ``torch.distributed`` job (FSDP, TP inside the group) and its ``TCPStore``
(``MASTER_ADDR``/``MASTER_PORT``) are the ones torchrun or the launcher made; the Manager of rank 0
serves the group's quorum requests and publishes its address in that store.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch

from hyper_parallel.ft.lighthouse import check_reachable, majority


def _advertised_host(lighthouse_address: str) -> str:
    """The host name other groups reach this group's Manager at: ``HP_FT_HOSTNAME`` if set, 127.0.0.1 when
    the lighthouse is on loopback (one machine), else this machine's host name (torchft's default)."""
    import socket
    from hyper_parallel.ft.lighthouse import split_address
    if os.environ.get("HP_FT_HOSTNAME"):
        return os.environ["HP_FT_HOSTNAME"]
    host, _ = split_address(lighthouse_address)
    return "127.0.0.1" if host in ("127.0.0.1", "localhost", "::1") else socket.gethostname()


def make_manager(*, replica_group_id: int, num_replica_groups: int, lighthouse: str,
                 min_replicas: Optional[int] = None, group_rank: Optional[int] = None,
                 group_world_size: Optional[int] = None, store_addr: Optional[str] = None,
                 store_port: Optional[int] = None, timeout_s: float = 30.0, quorum_timeout_s: float = 60.0,
                 connect_timeout_s: float = 10.0, heartbeat_interval_ms: int = 100):
    """A ``torchft.Manager`` for this rank of replica group ``replica_group_id`` (of ``num_replica_groups``).

    ``min_replicas`` (default: a majority of the groups, see :mod:`hyper_parallel.ft.lighthouse`) is the
    Manager's ``min_replica_size``: a step commits only in a quorum of at least that many groups.
    ``timeout_s`` bounds every cross-group collective and the heal; ``quorum_timeout_s`` the wait for a
    quorum. The quorum is synchronous (taken at ``zero_grad``, before the forward), so a healing group
    loads the live state before it computes anything. Raises ``ValueError`` for a bad argument and
    ``ConnectionError`` when no lighthouse answers at ``lighthouse`` (on every rank, in bounded time).
    """
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    if not isinstance(num_replica_groups, int) or isinstance(num_replica_groups, bool) or num_replica_groups < 1:
        raise ValueError(f"num_replica_groups must be an int >= 1, got {num_replica_groups!r}")
    if not isinstance(replica_group_id, int) or isinstance(replica_group_id, bool) \
            or not 0 <= replica_group_id < num_replica_groups:
        raise ValueError(f"replica_group_id={replica_group_id!r} is out of range: expected an int in "
                         f"[0, {num_replica_groups}) for num_replica_groups={num_replica_groups}")
    if min_replicas is None:
        min_replicas = majority(num_replica_groups)
    if not isinstance(min_replicas, int) or not 1 <= min_replicas <= num_replica_groups:
        raise ValueError(f"min_replicas={min_replicas!r}: expected an int in [1, {num_replica_groups}] "
                         f"(num_replica_groups={num_replica_groups})")
    address = check_reachable(lighthouse, timeout_s=connect_timeout_s)
    timeout = timedelta(seconds=timeout_s)
    cuda = torch.cuda.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_backend() == "nccl"
    pg = ProcessGroupNCCL(timeout=timeout) if cuda else ProcessGroupGloo(timeout=timeout)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    transport = PGTransport(pg, timeout=timeout, device=device)
    manager = Manager(
        pg=pg, load_state_dict=None, state_dict=None, min_replica_size=min_replicas,
        use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=quorum_timeout_s),
        connect_timeout=timedelta(seconds=connect_timeout_s),
        rank=group_rank if group_rank is not None else int(os.environ.get("RANK", "0")),
        world_size=group_world_size if group_world_size is not None else int(os.environ.get("WORLD_SIZE", "1")),
        store_addr=store_addr or os.environ.get("MASTER_ADDR", "127.0.0.1"),
        store_port=store_port or int(os.environ["MASTER_PORT"]),
        lighthouse_addr=address, replica_id=f"hp_replica_{replica_group_id}",
        hostname=_advertised_host(address),
        heartbeat_interval=timedelta(milliseconds=heartbeat_interval_ms), checkpoint_transport=transport,
        init_sync=True)
    manager._hp_num_replica_groups = num_replica_groups
    manager._hp_replica_group_id = replica_group_id
    return manager
