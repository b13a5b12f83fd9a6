"""Single-process fp32 training: the ground truth that distributed training is compared against.

Why deterministic: weights come from ``build_model(args, seed)``, batch ``step``
from ``TokenBatches(seed=seed).get_batch(step, ...)``, and nothing else draws
random numbers (no dropout), so the same call returns bit-identical losses on
every run with the same thread count. (Changing ``torch.set_num_threads`` may
change float summation order, hence the last bits.)

Run as a script for a quick look:  python -m examples.llama.reference --config tiny
"""
from __future__ import annotations

import argparse
import time
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from examples.llama.configs import OptimConfig, get_config
from examples.llama.data import TokenBatches
from examples.llama.model import ModelArgs, Transformer, build_model, loss_fn
from examples.llama.moe import update_expert_bias


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over one parameter group (weight decay on every parameter, as the reference does)."""
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               max_grad_norm: float) -> Tuple[float, float]:
    """One step: forward, mean CE loss, backward, clip to ``max_grad_norm``, AdamW. Returns (loss, grad_norm)."""
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    update_expert_bias(model)  # MoE: aux-loss-free balancing from this step's counts (no-op for dense)
    return loss.item(), float(grad_norm)


def train_reference(args: ModelArgs, steps: int, lr: Optional[float] = None, seed: int = 0,
                    global_batch: int = 8, seq_len: int = 32, optim: Optional[OptimConfig] = None,
                    data: Optional[TokenBatches] = None,
                    ) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """Train ``build_model(args, seed)`` for ``steps`` on the global batches of ``TokenBatches(seed=seed)``.

    ``lr`` overrides ``optim.lr`` (default ``OptimConfig()``). Returns the loss of
    every step (before that step's update) and the final state_dict (cloned).
    """
    optim = optim or OptimConfig()
    if lr is not None:
        optim = OptimConfig(lr=lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay,
                            max_grad_norm=optim.max_grad_norm)
    data = data or TokenBatches(seed=seed)
    model = build_model(args, seed)
    opt = build_optimizer(model.parameters(), optim)
    losses = []
    for step in range(steps):
        x, y = data.get_batch(step, global_batch, seq_len)
        loss, _ = train_step(model, opt, x, y, optim.max_grad_norm)
        losses.append(loss)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="write <out>.csv and <out>.png loss curves")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = get_config(a.config)
    steps = a.steps or cfg.steps
    t0 = time.perf_counter()
    losses, _ = train_reference(cfg.model, steps, seed=cfg.seed, global_batch=cfg.global_batch,
                                seq_len=cfg.seq_len, optim=cfg.optim)
    dt = time.perf_counter() - t0
    print(f"{a.config}: {Transformer(cfg.model).num_params():,} params, {steps} steps, "
          f"{dt / steps * 1000:.1f} ms/step, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    if a.out:
        from examples.llama.plot import save_loss_curves
        print("wrote", *save_loss_curves(a.out, {"reference": losses}, title=f"{a.config} reference"))


if __name__ == "__main__":
    main()
