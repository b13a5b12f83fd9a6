"""torchtitan configs for the CPU check (``--module titan_configs --config NAME``): torchtitan's own
debug configs with the maskless SDPA inner attention (torchtitan's ``ScaledDotProductAttention``,
causal; FlexAttention has no CPU backward); nothing else changed."""
import dataclasses

from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3 import config_registry as _llama3
from torchtitan.models.qwen3 import config_registry as _qwen3


def _sdpa(cfg, seen=None):
    """Replace every FlexAttention config inside ``cfg`` by SDPA's (in place)."""
    seen = {} if seen is None else seen   # id -> what it became (configs are shared between layers)
    if id(cfg) in seen:
        return seen[id(cfg)]
    seen[id(cfg)] = cfg
    if isinstance(cfg, FlexAttention.Config):
        seen[id(cfg)] = ScaledDotProductAttention.Config()
        return seen[id(cfg)]
    if isinstance(cfg, list):
        for i, v in enumerate(cfg):
            cfg[i] = _sdpa(v, seen)
    elif isinstance(cfg, dict):
        for k, v in cfg.items():
            cfg[k] = _sdpa(v, seen)
    elif dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        for f in dataclasses.fields(cfg):
            v = getattr(cfg, f.name)
            nv = _sdpa(v, seen)
            if nv is not v:
                setattr(cfg, f.name, nv)
    return cfg


def llama3_debugmodel_sdpa():
    config = _llama3.llama3_debugmodel()
    _sdpa(config.model_spec.model)
    return config


def qwen3_moe_debug_sdpa():
    config = _qwen3.qwen3_moe_debug()
    _sdpa(config.model_spec.model)
    return config


def llama3_debugmodel_sdpa_noac():
    """The same without activation checkpointing (recomputation is exact: the losses are the same)."""
    config = llama3_debugmodel_sdpa()
    config.activation_checkpoint = None
    return config


def qwen3_moe_debug_sdpa_noac():
    config = qwen3_moe_debug_sdpa()
    config.activation_checkpoint = None
    return config


def _as(cls, cfg, **changes):
    """``cfg``'s field values in the config class ``cls`` (a subclass of ``type(cfg)``)."""
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
    values.update(changes)
    return cls(**values)


def _separate_qkv(model_cfg):
    """Every layer's fused ``wqkv`` as torchtitan's stock separate ``wq`` / ``wk`` / ``wv`` (``QKVLinear``, its
    ``fuse_qkv=False``), initialised alike (in place)."""
    from torchtitan.models.common.attention import FusedQKVLinear, QKVLinear
    from torchtitan.models.llama3 import _LINEAR_INIT
    for layer in model_cfg.layers:
        qkv = layer.attention.qkv_linear
        if isinstance(qkv, FusedQKVLinear.Config):
            hd = qkv.head_dim
            layer.attention.qkv_linear = QKVLinear.Config(
                head_dim=hd,
                wq=dataclasses.replace(qkv.wqkv, out_features=qkv.n_heads * hd, param_init=_LINEAR_INIT),
                wkv=dataclasses.replace(qkv.wqkv, out_features=qkv.n_kv_heads * hd, param_init=_LINEAR_INIT))


def llama3_debugmodel_sdpa_noac_ft():
    """llama3_debugmodel_sdpa_noac on torchtitan's fault-tolerant trainer (torchtitan.experiments.torchft:
    ``--fault_tolerance.enable`` and its replica-group settings; the optimizer and checkpoint manager
    are its torchft variants, as in its own ``llama3_torchft_debugmodel``), with separate q/k/v projections:
    torchft reads a live group's state dict in its quorum thread while the forward runs, and the fused
    ``wqkv``'s save hook all-gathers the shards there (racing the forward's FSDP all-gather on the same
    gloo group: torch's own stack aborts, "Received data size doesn't match expected size")."""
    from torchtitan.experiments.torchft.checkpoint import TorchFTCheckpointManager
    from torchtitan.experiments.torchft.optimizer import TorchFTOptimizersContainer
    from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer
    base = llama3_debugmodel_sdpa_noac()
    _separate_qkv(base.model_spec.model)
    return _as(FaultTolerantTrainer.Config, base,
               optimizer=_as(TorchFTOptimizersContainer.Config, base.optimizer),
               checkpoint=_as(TorchFTCheckpointManager.Config, base.checkpoint))
