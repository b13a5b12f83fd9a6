"""Split a torchtitan-shaped model into pipeline stages, keeping every parameter's name.

The model has input modules (``tok_embeddings``), a dict of blocks (``layers``, a ``ModuleDict``
keyed by the block's index) and output modules (``norm``, ``output``). The input modules count
as one extra layer on the first stage and the output modules as one extra layer on the last, so
those stages get fewer blocks. A stage is a copy of the model with the modules it does not own
deleted (blocks removed from ``layers``, input/output modules set to ``None``): its parameters
keep the unsplit model's fully qualified names, and the model's ``forward`` must skip ``None``
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


def plan_stages(layer_names, num_stages=None, layers_per_stage=None, *, input_weight: int = 1,
                output_weight: int = 1) -> list:
    """Blocks of each stage: a list of ``num_stages`` lists of block names.

    The first stage carries ``input_weight`` extra layers (the embedding) and the last
    ``output_weight`` (norm and output head). With ``layers_per_stage=K`` every stage holds K
    layers but the last, which holds the rest, and ``num_stages`` is ``ceil(total / K)``; with
    ``num_stages=S`` the layers are dealt out as evenly as possible, the first stages taking
    one more when they do not divide.
    """
    names = list(layer_names)
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
                      output_modules=("norm", "output")):
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
    """
    style, per_rank = _kind(schedule)
    if pp_mesh is None or getattr(pp_mesh, "ndim", None) != 1:
        raise ValueError(f"split_into_stages: pp_mesh must be a 1-D DeviceMesh (the pipeline dim), got {pp_mesh!r}")
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
        num_stages = pp_size * (per_rank or 2)
    w_in = 1 if any(getattr(model, n, None) is not None for n in input_modules) else 0
    w_out = 1 if any(getattr(model, n, None) is not None for n in output_modules) else 0
    plan = plan_stages(list(blocks.keys()), num_stages, layers_per_stage, input_weight=w_in, output_weight=w_out)
    num_stages = len(plan)
    mine = stage_ids_on_rank(pp_rank, pp_size, num_stages, style)

    def owned(s):
        keep = [f"{layers}.{k}" for k in plan[s]]
        if s == 0:
            keep += list(input_modules)
        if s == num_stages - 1:
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


def _build(model, s, plan, layers, input_modules, output_modules):
    num_stages = len(plan)
    keep_blocks = set(plan[s])
    stage = copy.deepcopy(model)
    sb = getattr(stage, layers)
    for k in list(sb.keys()):
        if k not in keep_blocks:
            del sb[k]
    for n in input_modules:
        if s != 0 and getattr(stage, n, None) is not None:
            setattr(stage, n, None)
    for n in output_modules:
        if s != num_stages - 1 and getattr(stage, n, None) is not None:
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
    plan = plan_stages(list(blocks.keys()), num_stages, layers_per_stage, input_weight=w_in, output_weight=w_out)
    if isinstance(stage_index, bool) or not isinstance(stage_index, int) or not 0 <= stage_index < len(plan):
        raise ValueError(f"stage_module: stage_index={stage_index!r} is out of range for {len(plan)} stages")
    return _build(model, stage_index, plan, layers, input_modules, output_modules)
