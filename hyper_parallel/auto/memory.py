"""Per-rank memory: parameters, gradients and optimizer states exactly (the library's layouts, torch.chunk
rules), activations and communication buffers estimated from the meta trace (docs/auto_parallel.md).

Layouts (what ``Plan.apply`` builds): TP shards colwise roles on dim 0 and rowwise Linears on dim 1,
the embedding on dim 0 (torch's RowwiseParallel for ``nn.Embedding``); norms, router and ``replicate``
roles stay whole. Grouped experts are ``Shard(0)`` over ep. FSDP then chunks dim 0 of the TP-local
tensor over the fsdp ranks (x cp: context parallel ranks shard parameters too, as torchtitan does),
experts over fsdp / ep. ``torch.chunk`` gives the first ranks ``ceil(n / k)``, so rank 0 (index 0 on
every mesh dim) holds the most bytes of every parameter: the maximum over ranks is rank 0's total
(over every pipeline stage's rank 0 with pp).
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Dict, List, Tuple

import torch

from hyper_parallel.auto.roles import COLWISE, ROWWISE, ModelInfo

OPT_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}


def chunk0(size: int, chunks: int) -> int:
    """Size of the first of ``torch.chunk(range(size), chunks)`` (the largest)."""
    if chunks <= 1 or size == 0:
        return size
    return -(-size // chunks)


def local_shape(shape, role: str, tp_size: int, shard: int, ep_size: int = 1, expert_shard: int = 1) -> Tuple[int, ...]:
    """Rank 0's local shape of a parameter of ``role`` under tp, then FSDP over ``shard`` ranks."""
    s = list(shape)
    if role == "experts":
        if s:
            s[0] = chunk0(s[0] // ep_size if ep_size > 1 else s[0], expert_shard)
        return tuple(s)
    if tp_size > 1 and s:
        if role in COLWISE or role == "embedding":
            s[0] = chunk0(s[0], tp_size)
        elif role in ROWWISE and len(s) >= 2:
            s[1] = chunk0(s[1], tp_size)
    if shard > 1 and s:
        s[0] = chunk0(s[0], shard)
    return tuple(s)


def _numel(shape):
    n = 1
    for v in shape:
        n *= v
    return n


@dataclasses.dataclass
class ParamGroups:
    """Parameters grouped as (role, shape, itemsize) -> count: per block kind, and outside the blocks."""

    kinds: List[Counter]        # distinct blocks' parameter groups
    block_kind: List[int]       # kind of each block
    first: Counter              # before the blocks (embedding): pipeline stage 0
    last: Counter               # after the blocks (final norm, head): last stage
    n_tensors_kind: List[int]
    n_tensors_first: int
    n_tensors_last: int
    kind_dense_bytes: List[int]   # unsharded bytes of a block of this kind, grouped experts excluded
    kind_expert_bytes: List[int]  # unsharded bytes of its grouped experts
    _cache: dict = dataclasses.field(default_factory=dict)

    def bytes_of(self, which, tp_size, shard, ep_size, expert_shard) -> int:
        key = (which, tp_size, shard, ep_size, expert_shard)
        v = self._cache.get(key)
        if v is None:
            c = self.first if which == "first" else self.last if which == "last" else self.kinds[which]
            v = self._cache[key] = _bytes(c, tp_size, shard, ep_size, expert_shard)
        return v


def group_params(info: ModelInfo) -> ParamGroups:
    nb = len(info.block_names)
    blocks = [Counter() for _ in range(nb)]
    first, last = Counter(), Counter()
    nt = [0] * nb
    dense, expert = [0] * nb, [0] * nb
    nf = nl = 0
    for p in info.params:
        key = (p.role, p.shape, torch.empty((), dtype=p.dtype).element_size())
        if p.block is not None:
            blocks[p.block][key] += 1
            nt[p.block] += 1
            if p.role == "experts":
                expert[p.block] += _numel(p.shape) * key[2]
            else:
                dense[p.block] += _numel(p.shape) * key[2]
        elif p.role == "embedding":
            first[key] += 1
            nf += 1
        else:
            last[key] += 1
            nl += 1
    kinds, kind_of, index = [], [], {}
    for b in blocks:
        sig = tuple(sorted(b.items()))
        if sig not in index:
            index[sig] = len(kinds)
            kinds.append(b)
        kind_of.append(index[sig])
    first_block = {k: kind_of.index(k) for k in range(len(kinds))}
    return ParamGroups(kinds, kind_of, first, last, [nt[first_block[k]] for k in range(len(kinds))], nf, nl,
                       [dense[first_block[k]] for k in range(len(kinds))],
                       [expert[first_block[k]] for k in range(len(kinds))])


def _bytes(counter: Counter, tp_size, shard, ep_size, expert_shard) -> int:
    total = 0
    for (role, shape, item), cnt in counter.items():
        total += cnt * item * _numel(local_shape(shape, role, tp_size, shard, ep_size, expert_shard))
    return total


def shard_degrees(degrees: Dict[str, int]) -> Tuple[int, int]:
    """(ranks that shard a dense parameter, ranks that shard an expert's local slice) under FSDP."""
    cp = degrees["cp"]
    # cp ranks shard parameters with fsdp; a pipeline without fsdp shards over cp alone (it reduces the
    # gradients over cp with FSDP, having no replicate)
    shard = degrees["fsdp"] * cp if degrees["fsdp"] > 1 or degrees.get("pp", 1) > 1 else 1
    ep = degrees["ep"]
    return shard, (shard // ep if ep > 1 else shard)


def state_bytes_per_stage(groups: ParamGroups, degrees: Dict[str, int], stages: List[List[int]],
                          optimizer: str = "adamw") -> List[Tuple[int, int, int, int]]:
    """For each pipeline stage (``stages``: block indices per stage): (params, grads, optimizer, n_tensors)
    bytes of the stage's rank 0."""
    tp, ep = degrees["tp"], degrees["ep"]
    shard, expert_shard = shard_degrees(degrees)
    n_opt = OPT_STATES[optimizer]
    out = []
    for s, idx in enumerate(stages):
        cnt = Counter(groups.block_kind[i] for i in idx)
        b = sum(n * groups.bytes_of(k, tp, shard, ep, expert_shard) for k, n in cnt.items())
        n = sum(c * groups.n_tensors_kind[k] for k, c in cnt.items())
        if s == 0:
            b += groups.bytes_of("first", tp, shard, ep, expert_shard)
            n += groups.n_tensors_first
        if s == len(stages) - 1:
            b += groups.bytes_of("last", tp, shard, ep, expert_shard)
            n += groups.n_tensors_last
        out.append((b, b, n_opt * b, n))
    return out
