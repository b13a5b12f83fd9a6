"""Failed collectives on torch: errors that name the collective, the timeout on groups, the desync check.

**Errors.** Every ``torch.distributed`` call the library makes (``collectives.py``, ``p2p.py``,
``fully_shard``'s asynchronous all_gather / reduce_scatter and their waits, the pipeline
schedules' step) is wrapped in a ``try/except RuntimeError`` that re-raises
:class:`~hyper_parallel.distributed.collective_errors.CollectiveError` naming the collective, the group's ranks,
the mesh dims the group serves (:meth:`CommGroup.name_dim`) and the peer of a point-to-point
message, with torch's error chained. No cost on the healthy path (a ``try`` block is free in
CPython 3.11). How a dead peer shows up: gloo reports "Connection closed by peer" /
"Connection reset by peer" as soon as a survivor reads from the dead process's socket (milliseconds),
and a peer that is alive but never joins ends in "Timed out waiting ...ms" after the group's
timeout; NCCL raises ``DistBackendError`` (watchdog timeout, remote error).

**Timeout.** :func:`group_timeout` is the one value (``faults.collective_timeout()``); the ground floor
passes it to ``init_process_group`` and ``new_group``, and :func:`adopt` applies it (public
``ProcessGroup.set_timeout``) to a group the library did not create once the value was chosen
explicitly.

**Desync check** (``faults.CHECK``): :func:`check` runs before a group collective when enabled: one
all_gather of a 64-bit hash of this rank's description (op, group, mesh dims, shape, dtype, the
redistribution's placements, arguments, call site), and on a mismatch one ``all_gather_object`` of
the descriptions, then :class:`CollectiveMismatchError` on every rank. :func:`check_p2p` does the
same pairwise for the cross-mesh exchange.
"""
from __future__ import annotations

import os
import sys
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from hyper_parallel.distributed import collective_errors as faults
from hyper_parallel.distributed.collective_errors import CollectiveError, CollectiveMismatchError

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../hyper_parallel
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))

_CLOSED = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
           "socket closed", "remote process exited", "no route to host")
_TIMEOUT = ("timed out", "timeout")
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 name


# ------------------------------------------------------------------ errors

def _my_rank():
    try:
        return dist.get_rank()
    except (RuntimeError, ValueError):
        return -1


def where(group, dims: bool = True):
    """``"ranks (0, 1) [mesh dim 0 'tp' of mesh (2,)]"`` for a CommGroup (or None: the default group).

    The bracket lists the mesh dims served by the group (meshes over the same ranks share it), newest first.
    """
    if group is None:
        return "the default group"
    names = getattr(group, "dims", ()) if dims else ()
    return f"ranks {tuple(group.ranks)}" + (f" [{'; '.join(names)}]" if names else "")


def classify(exc) -> str:
    text = str(exc).lower()
    if any(s in text for s in _CLOSED):
        return "peer closed"
    if any(s in text for s in _TIMEOUT):
        return "timeout"
    return "error"


def error(collective: str, group, exc, *, peer=None) -> CollectiveError:
    """The :class:`CollectiveError` for torch's ``exc`` raised by the collective ``collective`` on ``group``."""
    reason = classify(exc)
    me = _my_rank()
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    peer_txt = f" with peer rank {peer}" if peer is not None else ""
    if reason == "peer closed":
        who = (f"peer rank {peer}" if peer is not None else
               "a peer among " + where(group) if group is not None else "a peer")
        why = (f"{who} closed its connection: that process died or exited (look at its log for the first "
               "error; the other survivors fail the same way)")
    elif reason == "timeout":
        t = group_timeout_s(group)
        why = (f"no answer within the collective timeout ({f'{t:g} s' if t else 'the group timeout'}; set it with "
               f"{faults.TIMEOUT_ENV} or hyper_parallel.debug.set_collective_timeout): a peer is hung, "
               "dead, or issuing a different collective (HYPER_PARALLEL_CHECK_COLLECTIVES=1 diagnoses that)")
    else:
        why = "the backend raised an error"
    on = f" on {where(group)}" if group is not None else ""
    msg = (f"hyper_parallel: {collective}{on}{peer_txt} failed on rank {me}: {why}. "
           f"torch said: {type(exc).__name__}: {first}")
    return CollectiveError(msg, collective=collective, ranks=tuple(group.ranks) if group is not None else None,
                           where=getattr(group, "dims", None) or None, peer=peer, reason=reason)


def fail(collective: str, group, exc, *, peer=None):
    """Raise the :class:`CollectiveError` for ``exc`` (chained); an error already ours passes through."""
    if isinstance(exc, CollectiveError):
        raise exc
    raise error(collective, group, exc, peer=peer) from exc


def wait(work, collective: str, group, *, peer=None) -> None:
    """``work.wait()`` with torch's error turned into a :class:`CollectiveError`."""
    try:
        work.wait()
    except RuntimeError as exc:
        fail(collective, group, exc, peer=peer)


def is_comm_error(exc) -> bool:
    """Whether ``exc`` (raised somewhere in torch's pipeline runtime) came from communication."""
    if isinstance(exc, CollectiveError):
        return False
    backend = getattr(dist, "DistBackendError", None)
    if backend is not None and isinstance(exc, backend):
        return True
    text = str(exc).lower()
    return "gloo" in text or "nccl" in text or any(s in text for s in _CLOSED) or "timed out waiting" in text


# ------------------------------------------------------------------ timeout

def group_timeout() -> timedelta:
    return timedelta(seconds=faults.collective_timeout())


def group_timeout_s(group):
    """The timeout the library gave ``group``'s process group, or None (a group it left alone)."""
    handle = getattr(group, "handle", None)
    for h, t in _adopted:
        if h is handle:
            return t
    return None


_adopted = []  # [process group, timeout it was given (s) or None]: the groups the library uses


def adopt(handle, created: bool) -> None:
    """Remember ``handle`` for :func:`set_collective_timeout`; a group not created by the library
    gets the library's timeout only when one was chosen explicitly."""
    if handle is None or any(h is handle for h, _ in _adopted):
        return
    entry = [handle, None]
    _adopted.append(entry)
    if created:
        entry[1] = faults.collective_timeout()
    elif faults.timeout_is_explicit():
        _set_timeout(entry, faults.collective_timeout())


def _set_timeout(entry, seconds):
    try:
        entry[0].set_timeout(timedelta(seconds=seconds))  # public ProcessGroup.set_timeout
    except (AttributeError, RuntimeError):  # pragma: no cover - a backend without set_timeout
        return
    entry[1] = seconds


def _apply_everywhere(seconds):
    for entry in list(_adopted):
        _set_timeout(entry, seconds)


faults.on_timeout_change(_apply_everywhere)


def forget_groups() -> None:
    _adopted.clear()


# ------------------------------------------------------------------ desync check

def _placements_of(frame):
    """The redistribution's placements seen from a library frame (``plan`` with ``src``/``dst`` layouts)."""
    plan = frame.f_locals.get("plan")
    src = getattr(plan, "src", None)
    dst = getattr(plan, "dst", None)
    if src is not None and dst is not None and hasattr(src, "placements"):
        return f"placements {tuple(src.placements)} -> {tuple(dst.placements)}"
    return None


def call_site(with_line: bool = True) -> str:
    """``library function <- user file:line`` of the running collective (frames of torch skipped)."""
    f = sys._getframe(2)
    lib, user, placements = None, None, None
    while f is not None:
        fn = f.f_code.co_filename
        if fn.startswith(_PKG_DIR):
            if placements is None:
                placements = _placements_of(f)
            lib = f"{os.path.relpath(fn, os.path.dirname(_PKG_DIR))}:{f.f_code.co_name}"  # the outermost one
        elif not fn.startswith(_TORCH_DIR) and not fn.startswith("<"):
            user = f"{fn}:{f.f_lineno}" if with_line else fn
            break
        f = f.f_back
    parts = [p for p in (placements, f"in {lib}" if lib else None, f"called from {user}" if user else None) if p]
    return ", ".join(parts)


def describe(collective: str, group, tensor=None, detail: str = "", *, peer=None, site: str = None, shape=True,
             dims=True) -> str:
    d = f"{collective} on {where(group, dims)}"
    if peer is not None:
        d += f" with peer {peer}"
    if tensor is not None:
        d += (f", tensor {list(tensor.shape)} " if shape else ", ") + str(tensor.dtype).replace('torch.', '')
    if detail:
        d += f", {detail}"
    s = call_site() if site is None else site
    return d + (f", {s}" if s else "")


def _hash(text: str) -> int:
    return (zlib.crc32(text.encode()) << 31) ^ zlib.adler32(text.encode())


def check(collective: str, group, tensor=None, detail: str = "", shape: bool = True) -> None:
    """Compare this collective's description across ``group`` (collective); raise on a mismatch, everywhere.

    Called only when ``faults.CHECK[0]`` is on (the callers test it first).
    """
    if group is None or group.size <= 1 or torch.compiler.is_compiling():
        return
    site = call_site()
    desc = describe(collective, group, tensor, detail, shape=shape, site=site)
    # the hash leaves out the mesh-dim names: a group's list depends on which meshes were built before
    key = describe(collective, group, tensor, detail, shape=shape, site=site, dims=False)
    dev = tensor.device if tensor is not None else torch.device("cpu")
    if dev.type == "meta":
        dev = torch.device("cpu")
    mine = torch.tensor([_hash(key)], dtype=torch.int64, device=dev)
    every = mine.new_empty(group.size)
    try:
        _all_gather_single(every, mine, group=group.handle)
    except RuntimeError as exc:
        fail(f"collective check before {collective}", group, exc)
    if bool((every == mine[0]).all()):
        return
    descs = [None] * group.size
    try:
        dist.all_gather_object(descs, desc, group=group.handle)
    except RuntimeError as exc:
        fail(f"collective check before {collective}", group, exc)
    raise _mismatch(collective, group, dict(zip(group.ranks, descs)))


def _mismatch(collective, group, by_rank, peer=None):
    me = _my_rank()
    lines = "\n".join(f"  rank {r}: {d}" for r, d in sorted(by_rank.items()))
    msg = (f"hyper_parallel: the ranks of {where(group)} are about to issue different collectives "
           f"(desynchronized; rank {me} was about to issue {collective}):\n{lines}\n"
           "Common causes: a data-dependent branch, a plan or layout differing per rank, an uneven last batch. "
           f"(Checked because {faults.CHECK_ENV}=1 / hyper_parallel.debug.check_collectives().)")
    return CollectiveMismatchError(msg, collective=collective, ranks=tuple(group.ranks) if group is not None else None,
                                   where=getattr(group, "dims", None) or None, peer=peer, descriptions=by_rank)


def check_p2p(tensor, prog) -> None:
    """The cross-mesh exchange's check: each pair of peers compares what one sends and the other expects.

    Every peer in this rank's program gets ``[hash(what I send you), hash(what I expect from you)]``
    and sends the same back; both sides of a disagreeing pair raise with both descriptions.
    """
    me = prog.rank
    site = call_site(with_line=True)
    dt = str(tensor.dtype).replace("torch.", "")

    def n_of(pieces):
        total = 0
        for _st, sh in pieces:
            k = 1
            for s in sh:
                k *= s
            total += k
        return total

    # the call site goes into the message, not the hash: the two sides of a pipeline boundary may
    # reach the same exchange from different lines of the program
    sends = {p: f"{n_of(pc)} x {dt} from rank {me} to rank {p}" for p, pc in prog.sends}
    recvs = {p: f"{n_of(pc)} x {dt} from rank {p} to rank {me}" for p, pc in prog.recvs}
    peers = sorted(set(sends) | set(recvs))
    if not peers:
        return
    out, inc, ops = {}, {}, []
    for p in peers:
        s = sends.get(p, f"nothing from rank {me} to rank {p}")
        r = recvs.get(p, f"nothing from rank {p} to rank {me}")
        out[p] = (s, r)
        t = torch.tensor([_hash(s), _hash(r)], dtype=torch.int64, device=tensor.device)
        inc[p] = torch.empty(2, dtype=torch.int64, device=tensor.device)
        ops.append(dist.P2POp(dist.isend, t, p))
        ops.append(dist.P2POp(dist.irecv, inc[p], p))
    try:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    except RuntimeError as exc:
        fail("collective check before cross-mesh p2p", None, exc)
    for p in peers:
        s, r = out[p]
        # the peer's send to me must be what I expect from it, and the reverse
        if int(inc[p][0]) != _hash(r) or int(inc[p][1]) != _hash(s):
            theirs = [None]
            mine = [f"cross-mesh p2p: sends {s}; expects {r}; {site}"]
            try:
                if me < p:
                    dist.send_object_list(mine, dst=p)
                    dist.recv_object_list(theirs, src=p)
                else:
                    dist.recv_object_list(theirs, src=p)
                    dist.send_object_list(mine, dst=p)
            except RuntimeError as exc:
                fail("collective check before cross-mesh p2p", None, exc, peer=p)
            from hyper_parallel.distributed.comm_group import CommGroup
            raise _mismatch("cross-mesh p2p", CommGroup(sorted((me, p)), None, me), {me: mine[0], p: theirs[0]}, peer=p)


__all__ = ["error", "fail", "wait", "check", "check_p2p", "group_timeout", "adopt", "is_comm_error", "where"]
