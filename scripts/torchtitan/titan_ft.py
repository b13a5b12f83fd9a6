"""The fault-tolerance row of scripts/torchtitan_check.sh: fixes to torchtitan 0.3.0's fault-tolerant trainer,
the fault injection, and what each step records (used by run_titan.py with ``--fault_tolerance.enable``).

The same on both stacks (torch's and hyper_parallel's swap); see :func:`patch_trainer` for why each fix is
needed and docs/torchtitan.md ("torchtitan's fault tolerance") for the results.
"""
from __future__ import annotations

import hashlib
import os
import signal
import time


def patch_trainer(ft_trainer) -> None:
    """Four fixes to torchtitan 0.3.0's fault-tolerant trainer (``--fault_tolerance.enable``).

    * Its ``__init__`` (a copy of an older ``Trainer.__init__``) lags the base class in two steps, added
      here as the base class does them: it never calls ``set_spmd_backend`` (``--parallelism.spmd-backend``
      is ignored) and never hands the model's ``lm_head`` to the ``ChunkedLossWrapper`` loss (the first
      forward fails: "Set lm_head before calling ChunkedLossWrapper").
    * torchft's quorum is synchronous (``torchft.Manager(use_async_quorum=False)``; torchtitan's all-reduce
      hook, optimizer wrapper and loss sync are unchanged): with torchtitan's asynchronous quorum a live
      group's ``state_dict`` is read in torchft's quorum thread while the main thread runs the forward,
      and FSDP2's state-dict pre-hook swaps the modules' parameters back to their sharded DTensors
      mid-forward (torch's own stack fails: "aten.mm.default got mixed torch.Tensor and DTensor").
      Synchronous, the quorum, the heal and the state dict run at ``zero_grad``, before the forward.
    * The optimizer state a live group sends is current: ``TorchFTOptimizersContainer.state_dict`` returns a
      state dict cached at construction, whose tensors are the live ones but whose ``param_groups`` hold the
      learning rate of step 0; a group healed mid-run took that learning rate for its first step and its
      parameters left the live group's (torch's own stack: the healed group's SHA-256 of its shards differed
      from the survivor's at every later step). It is refreshed on each call (cheap: references, no copies).
    """
    import torchft
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.experiments.torchft.optimizer import TorchFTOptimizersContainer

    def optimizer_state_dict(self):
        self.init_cache_state_dict()
        return self.cache_state_dict
    TorchFTOptimizersContainer.state_dict = optimizer_state_dict

    class SyncQuorumManager(torchft.Manager):
        """torchft's Manager with a synchronous quorum; remembers its last commit decision."""

        def __init__(self, *args, **kwargs):
            kwargs["use_async_quorum"] = False
            super().__init__(*args, **kwargs)
            self.last_commit = None

        def should_commit(self, *args, **kwargs):
            self.last_commit = super().should_commit(*args, **kwargs)
            return self.last_commit

    torchft.Manager = SyncQuorumManager   # what torchtitan's experiments/torchft/manager.py constructs
    inner = ft_trainer.__init__

    def __init__(self, config):
        dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
        inner(self, config)
        if isinstance(self.loss_fn, ChunkedLossWrapper) and not self.parallel_dims.pp_enabled:
            (model,) = self.model_parts
            self.loss_fn.set_lm_head(model.lm_head)
            model._skip_lm_head = True
    ft_trainer.__init__ = __init__


def wait_for(path: str, timeout_s: float = 1800.0) -> None:
    """Say this process is ready (``path.ready.PID``), then block until ``path`` exists, at most ``timeout_s``
    (the groups start together, a spare waits to be let in)."""
    open(f"{path}.ready.{os.getpid()}", "w").close()
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"titan_ft: start gate {path} did not appear within {timeout_s:g} s")
        time.sleep(0.1)


def kill_in_backward(trainer, before_kill) -> None:
    """SIGKILL this rank when the backward reaches the middle transformer block (called on every rank of a
    group, so the whole group dies inside the backward: some gradients reduce-scattered and all-reduced
    across the groups, the rest not). ``before_kill()`` runs first (writes the record)."""
    (model,) = trainer.model_parts
    layers = list(model.layers.values()) if hasattr(model.layers, "values") else list(model.layers)
    block = layers[len(layers) // 2]

    def hook(module, grad_output):
        before_kill()
        print(f"titan_ft: rank {os.environ.get('RANK')} kills itself in the backward of step {trainer.step}",
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    block.register_full_backward_pre_hook(hook)


def _local(tensor):
    tensor = tensor.detach()
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def state_digests(trainer) -> dict:
    """SHA-256 of this rank's local model shards (``model``) and optimizer state (``optim``): the state torchft
    heals."""
    model, optim = hashlib.sha256(), hashlib.sha256()
    for part in trainer.model_parts:
        for name, param in part.named_parameters():
            model.update(name.encode())
            model.update(_local(param).contiguous().numpy().tobytes())
    for optimizer in trainer.optimizers.optimizers:
        for param in (p for group in optimizer.param_groups for p in group["params"]):
            for key, value in sorted(optimizer.state.get(param, {}).items()):
                if hasattr(value, "detach"):
                    optim.update(key.encode())
                    optim.update(_local(value).contiguous().numpy().tobytes())
    return {"model": model.hexdigest(), "optim": optim.hexdigest()}


def stack_of(trainer) -> dict:
    """Whose FSDP and DTensor the run used (the check that the swap took effect): the module of the model's
    ``FSDPModule`` base class and of its parameters' class."""
    (model,) = trainer.model_parts
    fsdp = next((c.__module__ for c in type(model).__mro__ if c.__name__ == "FSDPModule"), None)
    param = next(model.parameters())
    return {"fsdp_module": fsdp, "param_class": f"{type(param).__module__}.{type(param).__name__}"}


def step_state(trainer) -> dict:
    """What the row records per step besides loss and grad norm: torchft's decision and step, the groups in
    the quorum, the wall-clock time, the learning rate and this rank's state digests."""
    manager = trainer.ft_manager.manager
    return {"committed": manager.last_commit, "ft_step": manager.current_step(),
            "participants": manager.num_participants(), "t": time.time(),
            "lr": trainer.lr_schedulers.schedulers[0].get_last_lr()[0], "digest": state_digests(trainer)}
