"""The optimizer of a replica group: a step is committed only when the quorum agrees (torchft.Optimizer).

:class:`FTOptimizer` is torchft's ``OptimizerWrapper`` (quorum at ``zero_grad``, ``step`` only when
``manager.should_commit()``) plus one guard against split brain: a group that has never stepped in
a quorum with a peer (a fresh or restarted group) does not commit a step it takes alone, so a
restarted group heals from a live group before it moves its state (the Manager's healing is
``init_sync``). It records the outcome of every step for logs and tests.
"""
from __future__ import annotations

import time

import torch
from torchft.optim import OptimizerWrapper


class SoloGuard:
    """Refuse commits that a group takes alone before it ever stepped with a peer (see the module docstring).

    Call :meth:`before_commit` right before ``manager.should_commit()``; it reports an error to the
    Manager (so the group's vote is no) while the group is alone and has never had a peer, and
    raises ``TimeoutError`` once that has lasted ``alone_timeout_s``. A job of one group is never alone.
    """

    def __init__(self, manager, alone_timeout_s: float = 300.0):
        self.manager = manager
        self.joined_peer = getattr(manager, "_hp_num_replica_groups", 2) == 1
        self.alone_timeout_s = alone_timeout_s
        self._alone_since = None
        self.participants = 0

    def before_commit(self) -> None:
        manager = self.manager
        self.participants = manager.num_participants()
        if self.participants > 1:
            self.joined_peer = True
            return
        if self.joined_peer:
            return
        now = time.monotonic()
        self._alone_since = self._alone_since or now
        if now - self._alone_since > self.alone_timeout_s:
            raise TimeoutError(f"hyper_parallel.ft: no other replica group joined the quorum within "
                               f"{self.alone_timeout_s:g} s; this (fresh or restarted) group has no live group to "
                               "heal from and does not train alone (split brain). Check the other groups and "
                               "the lighthouse address")
        time.sleep(0.05)  # wait for a peer at about the lighthouse's quorum tick, not in a busy loop
        manager.report_error(RuntimeError(
            "hyper_parallel.ft: this replica group is alone in the quorum and has never stepped with a "
            "peer (fresh or restarted): it waits for a live group to heal from instead of committing"))


def guard_solo_commits(manager, alone_timeout_s: float = 300.0) -> SoloGuard:
    """Put a :class:`SoloGuard` in front of ``manager.should_commit`` (torchft's DiLoCo / LocalSGD call it)."""
    guard = SoloGuard(manager, alone_timeout_s)
    inner = manager.should_commit

    def should_commit(*args, **kwargs):
        guard.before_commit()
        return inner(*args, **kwargs)

    manager.should_commit = should_commit
    return guard


class FTOptimizer(OptimizerWrapper):
    """``torchft.optim.OptimizerWrapper`` with the :class:`SoloGuard` and a record of the steps.

    After ``step()``: ``last_committed`` (bool), ``last_step`` (the Manager's step number the step was
    taken at; the committed step numbers of a group are 0, 1, 2, ... with no repeats) and
    ``participants`` (groups in the quorum).
    """

    def __init__(self, manager, optim: torch.optim.Optimizer, alone_timeout_s: float = 300.0):
        super().__init__(manager, optim)
        self.guard = SoloGuard(manager, alone_timeout_s)
        self.last_committed = False
        self.last_step = -1
        self.participants = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # the quorum; a (re)started group heals here
        from hyper_parallel.ft.state import check_same_model
        check_same_model(self.manager)

    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("FTOptimizer.step: closures are not supported (torchft commits after the backward)")
        self.guard.before_commit()
        self.participants = self.guard.participants
        self.last_step = self.manager.current_step()
        self.last_committed = self.manager.should_commit()
        if self.last_committed:
            self.optim.step()
