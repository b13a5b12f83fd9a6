"""Starting and ending the default process group under torchrun: restart-safe stores, a clean exit.

**Restarts (``torchrun --max-restarts N --rdzv-backend c10d``).** torch's c10d rendezvous
handler shares one TCPStore between the agent and its workers (the default since torch 2.5;
``TORCHELASTIC_USE_AGENT_STORE=True`` in the workers' environment). The agent creates that
store server once and hands every round the same ``MASTER_ADDR:MASTER_PORT``, and
``init_process_group("env://")`` uses it with fixed key names: gloo's address exchange of the
world group is ``default_pg/0//cpu//0/<rank>``, that of the first ``new_group`` is
``default_pg/0//1//cpu//0/<rank>``. A restarted round therefore finds the dead round's keys
already set, reads a peer address of a process that no longer exists and fails in
``connectFullMesh`` (or hangs until the timeout). ``tools/elastic_repro.py`` shows it in
plain torch. The round's rendezvous prefix (``torch.rendezvous.<run>.<round>``) is applied
only to the agent's own view of the store, never to the workers'.

:func:`restart_safe_store` gives the workers of each restart attempt a key space of their own:
a client of the agent's store under ``PrefixStore("hyper_parallel/restart<N>/world<W>")``, where
``N`` is ``TORCHELASTIC_RESTART_COUNT``. Every agent counts its restarts itself; on one node
all ranks agree. Across nodes, torch does not guarantee the same count on every agent (an agent
whose workers were still healthy when a peer node re-rendezvoused restarts them without counting,
pytorch/pytorch#108158). For multi-node jobs that restart, launch with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: rank 0 then hosts a fresh store on a fresh port every
round, ``TORCHELASTIC_USE_AGENT_STORE`` is False and this module leaves the store to torch
(docs/checkpoint.md, docs/multi_node.md).

**Exit.** :func:`install_exit_hook` registers (once) an ``atexit`` function that destroys every
process group while the interpreter is still whole (see :func:`destroy_at_exit` and
docs/testing.md, "The gloo abort at exit").
"""
from __future__ import annotations

import atexit
import gc
import os
import sys
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

ENV_RESTART = "TORCHELASTIC_RESTART_COUNT"
ENV_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


def restart_prefix() -> Optional[str]:
    """The key prefix of this restart attempt, or None outside a torchrun agent's shared store."""
    if os.environ.get(ENV_AGENT_STORE) != "True" or ENV_RESTART not in os.environ:
        return None
    return f"hyper_parallel/restart{int(os.environ[ENV_RESTART])}/world{int(os.environ['WORLD_SIZE'])}"


def restart_safe_store(timeout: timedelta):
    """A store for ``init_process_group(store=...)`` that no earlier restart attempt has written to.

    None when torchrun's agent store is not in use (no elastic agent, static rendezvous, or
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): then ``init_method="env://"`` is right as it is.
    """
    prefix = restart_prefix()
    if prefix is None:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(prefix, store)


def init_default_group(backend: str, timeout: timedelta, release: Optional[Callable[[], None]] = None) -> None:
    """``init_process_group`` from torchrun's environment, restart-safe, with the exit hook installed."""
    store = restart_safe_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    install_exit_hook(release)


_hook = {"installed": False, "release": []}


def destroy_at_exit() -> None:
    """At interpreter exit (``atexit``): destroy the process groups and free them, threads joined.

    ``dist.destroy_process_group()`` only drops torch's own references; a ProcessGroupGloo and
    its threads (``pt_gloo_runloop``, ``gloo_tcp_loop``) live on while anything else holds it,
    here the ground floor's group cache and every mesh. Such a group is destroyed during the
    interpreter's teardown instead, with its threads still running, and that sometimes aborts the
    process ("terminate called without an active exception"; docs/testing.md). So: destroy,
    call the registered ``release`` functions (they drop the library's references) and collect,
    all while the interpreter is whole. Skipped after an uncaught exception (``sys.last_value``):
    a group whose peer died may have work that only its timeout ends, and the exit status is
    non-zero anyway.
    """
    if getattr(sys, "last_value", None) is not None:
        return
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # a group already broken by a dead peer: nothing left to tear down cleanly
        pass
    for release in _hook["release"]:
        release()
    gc.collect()


def install_exit_hook(release: Optional[Callable[[], None]] = None) -> None:
    """Register :func:`destroy_at_exit` with ``atexit`` once per process; ``release`` (once each)
    drops a holder's references to process groups at that point."""
    if release is not None and release not in _hook["release"]:
        _hook["release"].append(release)
    if not _hook["installed"]:
        atexit.register(destroy_at_exit)
        _hook["installed"] = True
