"""Split a torchtitan-shaped model into pipeline stages, keeping every parameter's name.

The model has input modules (``tok_embeddings``), a dict of blocks (``layers``, a ``ModuleDict``
keyed by the block's index) and output modules (``norm``, ``output``). By default the blocks are split
to balance the stages' cost (:func:`balanced_stage_layers` of :func:`stage_weights`: the input modules
weigh on the first stage and the output modules on the last by their FLOPs and bytes, so those stages
get fewer blocks when they are heavy), the split ``hyper_parallel.auto`` plans and ``Plan.apply`` builds;
``stage_layers=[...]`` gives every stage's block count (Megatron-style first / last stage counts:
``balanced_stage_layers(..., first_stage_layers=, last_stage_layers=)``), ``layers_per_stage=K`` K layers
per stage with the input and output modules counting one layer each. A stage is a copy of the model with the
modules it does not own deleted (blocks removed from ``layers``, input/output modules set to ``None``): its
parameters keep the unsplit model's fully qualified names, and the model's ``forward`` must skip ``None``
parts (the example Llama does).
"""
from __future__ import annotations

import copy



def _kind(schedule):
    from hyper_parallel.pipelining.schedules import schedule_kind
    return schedule_kind(schedule)


def stage_ids_on_rank(pp_rank: int, pp_size: int, num_stages: int, style: str) -> list:
    """The stage indices rank ``pp_rank`` runs: ``single`` (stage = rank), ``looped`` (rank r holds
    r, r + pp, r + 2 pp, ...) or ``v`` (rank r holds r and 2 pp - 1 - r)."""
    if style == "single":
        if num_stages != pp_size:
            raise ValueError(f"split_into_stages: num_stages={num_stages} with a one-stage-per-rank schedule on "
                             f"{pp_size} pipeline ranks; expected num_stages == {pp_size}")
        return [pp_rank]
    if style == "v":
        if num_stages != 2 * pp_size:
            raise ValueError(f"split_into_stages: num_stages={num_stages} with a V-shaped schedule on {pp_size} "
                             f"pipeline ranks; expected num_stages == 2 * {pp_size} (exactly 2 stages per rank)")
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    if style == "looped":
        if num_stages % pp_size:
            raise ValueError(f"split_into_stages: num_stages={num_stages} is not a multiple of the {pp_size} "
                             "pipeline ranks; a looped schedule puts the same number of stages on every rank")
        return list(range(pp_rank, num_stages, pp_size))
    raise ValueError(f"stage_ids_on_rank: style must be 'single', 'looped' or 'v', got {style!r}")


def balanced_stage_layers(block_weights, num_stages: int, *, first_weight: float = 0.0, last_weight: float = 0.0,
                          first_stage_layers: int = None, last_stage_layers: int = None,
                          allow_empty: bool = False) -> list:
    """Block counts per stage of a contiguous split that minimises the heaviest stage.

    ``block_weights``: one cost per block, in order; ``first_weight`` / ``last_weight``: the cost of what the
    first stage runs before the blocks (embedding) and the last after them (norm, head), in the same unit.
    ``first_stage_layers`` / ``last_stage_layers`` fix those stages' block counts (Megatron's
    ``--decoder-first/last-pipeline-num-layers``); the rest is balanced. No stage is left without a block
    unless ``allow_empty`` (fewer blocks than stages raises without it). Among the splits with the lightest
    heaviest stage, earlier stages take blocks first."""
    w = [float(x) for x in block_weights]
    n, S = len(w), num_stages
    if isinstance(S, bool) or not isinstance(S, int) or S < 1:
        raise ValueError(f"balanced_stage_layers: num_stages must be a positive int, got {S!r}")
    for name, v in (("first_stage_layers", first_stage_layers), ("last_stage_layers", last_stage_layers)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"balanced_stage_layers: {name} must be an int >= 0, got {v!r}")
    min_per = 0 if allow_empty else 1
    if n < S * min_per:
        raise ValueError(f"balanced_stage_layers: {n} blocks cannot give each of {S} stages a block; use fewer "
                         "stages or allow_empty=True")
    if S == 1:
        if first_stage_layers not in (None, n) or last_stage_layers not in (None, n):
            raise ValueError(f"balanced_stage_layers: one stage holds all {n} blocks, got first_stage_layers="
                             f"{first_stage_layers}, last_stage_layers={last_stage_layers}")
        return [n]
    prefix = [0.0]
    for x in w:
        prefix.append(prefix[-1] + x)

    def cost(stage, first, end):
        return (prefix[end] - prefix[first] + (first_weight if stage == 0 else 0.0)
                + (last_weight if stage == S - 1 else 0.0))

    def pack(limit):
        """Greedy counts with no stage above ``limit``, or None."""
        counts, lo = [], 0
        for s in range(S):
            if s == S - 1:
                k = n - lo
                if last_stage_layers is not None and k != last_stage_layers:
                    return None
            elif s == 0 and first_stage_layers is not None:
                k = first_stage_layers
            else:  # as many as fit, leaving the later stages their minimum
                later = (S - s - 2) * min_per + (last_stage_layers if last_stage_layers is not None else min_per)
                k = min_per
                while lo + k + 1 <= n - later and cost(s, lo, lo + k + 1) <= limit:
                    k += 1
            if k < 0 or lo + k > n or cost(s, lo, lo + k) > limit * (1 + 1e-12):
                return None
            counts.append(k)
            lo += k
        return counts

    lo_b, hi_b = 0.0, prefix[-1] + abs(first_weight) + abs(last_weight) + 1.0
    best = pack(hi_b)
    if best is None or (not allow_empty and min(best) < 1 and n >= S):
        raise ValueError(f"balanced_stage_layers: no split of {n} blocks into {S} stages with first_stage_layers="
                         f"{first_stage_layers}, last_stage_layers={last_stage_layers}")
    for _ in range(200):
        if hi_b - lo_b <= 1e-9 * max(hi_b, 1e-30):
            break
        mid = (lo_b + hi_b) / 2
        got = pack(mid)
        if got is None:
            lo_b = mid
        else:
            hi_b, best = mid, got
    return best


def stage_weights(model, layers: str = "layers", input_modules=("tok_embeddings",),
                  output_modules=("norm", "output")):
    """(block weights, first weight, last weight) of ``model`` for :func:`balanced_stage_layers`: each part's
    matmul FLOPs per token (2 x its parameters; an ``nn.Embedding`` lookup 0) relative to the mean block's,
    averaged with its parameter bytes relative to the mean block's (time and memory both count)."""
    import torch.nn as nn

    def flops_bytes(mods):
        fl = by = 0.0
        for m in mods:
            for sub in (m.modules() if m is not None else ()):
                for p in sub.parameters(recurse=False):
                    by += p.numel() * p.element_size()
                    fl += 0.0 if isinstance(sub, nn.Embedding) else 2.0 * p.numel()
        return fl, by

    per = [flops_bytes([b]) for b in getattr(model, layers).values()]
    return weights_of(per, flops_bytes([getattr(model, k, None) for k in input_modules]),
                      flops_bytes([getattr(model, k, None) for k in output_modules]))


def weights_of(blocks, first, last):
    """Weights from (FLOPs, bytes) pairs: each relative to the mean block's, the two averaged."""
    mf = sum(f for f, _ in blocks) / max(len(blocks), 1) or 1.0
    mb = sum(b for _, b in blocks) / max(len(blocks), 1) or 1.0
    weight = lambda fb: (fb[0] / mf + fb[1] / mb) / 2
    return [weight(x) for x in blocks], weight(first), weight(last)


def plan_stages(layer_names, num_stages=None, layers_per_stage=None, *, input_weight: int = 1,
                output_weight: int = 1, stage_layers=None) -> list:
    """Blocks of each stage: a list of ``num_stages`` lists of block names.

    The first stage carries ``input_weight`` extra layers (the embedding) and the last
    ``output_weight`` (norm and output head). With ``layers_per_stage=K`` every stage holds K
    layers but the last, which holds the rest, and ``num_stages`` is ``ceil(total / K)``; with
    ``num_stages=S`` the layers are dealt out as evenly as possible, the first stages taking
    one more when they do not divide.
    """
    names = list(layer_names)
    if stage_layers is not None:
        counts = list(stage_layers)
        if (any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts) or sum(counts) != len(names)
                or (num_stages is not None and num_stages != len(counts))):
            raise ValueError(f"split_into_stages: stage_layers={counts!r} must be {num_stages or 'one'} block "
                             f"count(s) >= 0 per stage summing to the {len(names)} blocks")
        out, pos = [], 0
        for c in counts:
            out.append(names[pos:pos + c])
            pos += c
        return out
    total = len(names) + input_weight + output_weight
    if layers_per_stage is not None:
        if isinstance(layers_per_stage, bool) or not isinstance(layers_per_stage, int) or layers_per_stage < 1:
            raise ValueError(f"split_into_stages: layers_per_stage must be a positive int, got {layers_per_stage!r}")
        s = -(-total // layers_per_stage)
        if num_stages is not None and num_stages != s:
            raise ValueError(f"split_into_stages: num_stages={num_stages} disagrees with layers_per_stage="
                             f"{layers_per_stage}: {len(names)} blocks + {input_weight + output_weight} "
                             f"input/output layers = {total} layers make {s} stages")
        counts = [layers_per_stage] * (s - 1) + [total - layers_per_stage * (s - 1)]
    else:
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"split_into_stages: num_stages must be a positive int, got {num_stages!r}")
        s = num_stages
        if s > total:
            raise ValueError(f"split_into_stages: num_stages={s} is more than the {total} layers "
                             f"({len(names)} blocks + {input_weight + output_weight} input/output layers)")
        counts = [total // s + (1 if i < total % s else 0) for i in range(s)]
    out, pos = [], -input_weight
    for c in counts:
        lo, hi = max(pos, 0), min(pos + c, len(names))
        out.append(names[lo:hi] if hi > lo else [])
        pos += c
    return out


def split_into_stages(model, pp_mesh, num_stages=None, layers_per_stage=None, schedule="1F1B", *,
                      layers: str = "layers", input_modules=("tok_embeddings",),
                      output_modules=("norm", "output"), stage_layers=None):
    """This rank's stages of ``model``: a list of ``(stage_index, module)``, by stage index.

    Args:
        model: the whole model (not modified; each stage is a deep copy with the parts it does
            not own deleted, so parameter names are unchanged).
        pp_mesh: the 1-D pipeline mesh (e.g. ``mesh["pp"]``); this rank's coordinate on it picks
            its stages.
        num_stages: total stages (default: one per rank for single-stage schedules, two per rank
            for looped and V schedules, or derived from ``layers_per_stage``).
        layers_per_stage: layers per stage (the embedding and the output head count as one layer
            each), instead of ``num_stages``.
        schedule: the schedule class or name (``"1F1B"``, ``"Interleaved1F1B"``, ``"ZBVZeroBubble"``
            ...): decides the stage-to-rank map (one per rank, looped, or V-shaped).
        layers / input_modules / output_modules: attribute names of the block dict and of the
            modules that go to the first / last stage.
        stage_layers: the block count of every stage (e.g. ``Plan.layers_per_stage``, or
            :func:`balanced_stage_layers` of :func:`stage_weights`), instead of the even split.
    """
    style, per_rank = _kind(schedule)
    if pp_mesh is None or getattr(pp_mesh, "ndim", None) != 1:
        raise ValueError(f"split_into_stages: pp_mesh must be a 1-D DeviceMesh (the pipeline mesh dim), got {pp_mesh!r}")
    pp_size, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    blocks = getattr(model, layers, None)
    if blocks is None or not hasattr(blocks, "keys"):
        raise ValueError(f"split_into_stages: model.{layers} must be a ModuleDict of blocks (keyed by block index, "
                         f"so that deleting blocks keeps the others' names), got {type(blocks).__name__}")
    ends = tuple(input_modules) + tuple(output_modules)
    known = set(ends) | {layers}
    for name, child in model.named_children():
        if name not in known and any(True for _ in child.parameters()):
            raise ValueError(f"split_into_stages: model.{name} has parameters but is neither a block nor one of "
                             f"the input modules {tuple(input_modules)} / output modules {tuple(output_modules)}; "
                             "name it in input_modules= or output_modules=")
    if any(True for _ in model._parameters.values()):
        raise ValueError("split_into_stages: the model has parameters of its own (not in a child module); "
                         "they cannot be assigned to a stage")
    if num_stages is None and layers_per_stage is None:
        num_stages = len(stage_layers) if stage_layers is not None else pp_size * (per_rank or 2)
    w_in = 1 if any(getattr(model, n, None) is not None for n in input_modules) else 0
    w_out = 1 if any(getattr(model, n, None) is not None for n in output_modules) else 0
    stage_layers = _default_split(model, layers, input_modules, output_modules, num_stages, layers_per_stage,
                                  stage_layers)
    plan = plan_stages(list(blocks.keys()), num_stages, layers_per_stage, input_weight=w_in, output_weight=w_out,
                       stage_layers=stage_layers)
    num_stages = len(plan)
    mine = stage_ids_on_rank(pp_rank, pp_size, num_stages, style)

    def owned(stage):
        keep = [f"{layers}.{k}" for k in plan[stage]]
        if stage == 0:
            keep += list(input_modules)
        if stage == num_stages - 1:
            keep += list(output_modules)
        return keep

    # a parameter reachable from two stages (tied embeddings split apart) cannot be trained by a pipeline
    where = {}
    for s in range(num_stages):
        for path in owned(s):
            mod = model.get_submodule(path) if getattr(model, path.split(".")[0], None) is not None else None
            for pname, p in (mod.named_parameters() if mod is not None else ()):
                where.setdefault(id(p), {})[s] = f"{path}.{pname}"
    for stages in where.values():
        if len(stages) > 1:
            raise ValueError(f"split_into_stages: one parameter is shared by stages {sorted(stages)} "
                             f"({', '.join(sorted(set(stages.values())))}); tied parameters must live on one "
                             "stage (untie them, e.g. tie_embeddings=False, or put both users on one stage)")
    return [(s, _build(model, s, plan, layers, input_modules, output_modules)) for s in mine]


def _default_split(model, layers, input_modules, output_modules, num_stages, layers_per_stage, stage_layers):
    """Without ``layers_per_stage`` / ``stage_layers``: the balanced split of :func:`stage_weights` (what
    ``hyper_parallel.auto`` plans and ``Plan.apply`` builds)."""
    if stage_layers is not None or layers_per_stage is not None or num_stages is None:
        return stage_layers
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"split_into_stages: num_stages must be a positive int, got {num_stages!r}")
    w, first, last = stage_weights(model, layers, input_modules, output_modules)
    return balanced_stage_layers(w, num_stages, first_weight=first, last_weight=last,
                                 allow_empty=len(w) < num_stages)


def _build(model, stage_index, plan, layers, input_modules, output_modules):
    num_stages = len(plan)
    keep_blocks = set(plan[stage_index])
    stage = copy.deepcopy(model)
    sb = getattr(stage, layers)
    for k in list(sb.keys()):
        if k not in keep_blocks:
            del sb[k]
    for n in input_modules:
        if stage_index != 0 and getattr(stage, n, None) is not None:
            setattr(stage, n, None)
    for n in output_modules:
        if stage_index != num_stages - 1 and getattr(stage, n, None) is not None:
            setattr(stage, n, None)
    return stage


def stage_module(model, stage_index, num_stages=None, layers_per_stage=None, *, layers: str = "layers",
                 input_modules=("tok_embeddings",), output_modules=("norm", "output")):
    """Stage ``stage_index`` of ``model`` split as :func:`split_into_stages` does, without a pipeline mesh
    (e.g. for :class:`HeteroPipelineStage`, whose stages live on meshes of their own)."""
    blocks = getattr(model, layers, None)
    if blocks is None or not hasattr(blocks, "keys"):
        raise ValueError(f"stage_module: model.{layers} must be a ModuleDict of blocks, got {type(blocks).__name__}")
    w_in = 1 if any(getattr(model, n, None) is not None for n in input_modules) else 0
    w_out = 1 if any(getattr(model, n, None) is not None for n in output_modules) else 0
    stage_layers = _default_split(model, layers, input_modules, output_modules, num_stages, layers_per_stage, None)
    plan = plan_stages(list(blocks.keys()), num_stages, layers_per_stage, input_weight=w_in, output_weight=w_out,
                       stage_layers=stage_layers)
    if isinstance(stage_index, bool) or not isinstance(stage_index, int) or not 0 <= stage_index < len(plan):
        raise ValueError(f"stage_module: stage_index={stage_index!r} is out of range for {len(plan)} stages")
    return _build(model, stage_index, plan, layers, input_modules, output_modules)
