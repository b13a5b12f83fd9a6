"""The fault-tolerance row of scripts/torchtitan_check.sh: per stack, each replica group's and life's steps
(torchtitan's reported loss, the groups in the quorum, committed or not), the heal (first committed step
of the restarted group, its state digests against the survivor's, torchft's transfer time), the time the
survivor lost, its step time alone and with both groups; then the two stacks side by side.

    python scripts/torchtitan/ft_report.py OUTDIR [STACK ...]

torchtitan's FT trainer reports the loss summed over the groups in the quorum (``dist_sum`` over its
``ManagedProcessGroup``); printed is that sum / the groups, the loss of the global batch.
"""
import json
import os
import re
import sys

LIVES = (("g0-1", "group 0"), ("g1-1", "group 1, first life (killed)"), ("g1-2", "group 1, the spare (healed)"))


def _load(out, stack, name, rank):
    path = os.path.join(out, f"{stack}-ft-{name}.json" + (f".rank{rank}" if rank else ""))
    return json.load(open(path))["steps"] if os.path.exists(path) else None


def _mean(step):
    """The loss of the global batch: torchtitan's sum over the quorum / its size (a step that failed reports
    only the group's own loss: its cross-group all_reduce failed)."""
    if not step.get("committed"):
        return step["loss"]
    return step["loss"] / max(1, step.get("participants") or 1)


def _heal_seconds(out, stack):
    """torchft's checkpoint transfer time per healed rank, from the spare's log."""
    path = os.path.join(out, f"{stack}-ft-g1-2.log")
    text = open(path, errors="replace").read() if os.path.exists(path) else ""
    return [float(t) for t in re.findall(r"fetching checkpoint from \S+ took ([0-9.]+)s", text)]


def report(out, stack):
    runs = {name: [_load(out, stack, name, r) for r in (0, 1)] for name, _ in LIVES}
    path = os.path.join(out, f"{stack}-ft-g0-1.json")
    whose = json.load(open(path)) if os.path.exists(path) else {}
    print(f"{stack}: FSDPModule from {whose.get('fsdp_module')}, parameters {whose.get('param_class')}")
    for name, title in LIVES:
        steps = runs[name][0]
        if not steps:
            print(f"  {title}: no record (see {out}/{stack}-ft-{name}.log)")
            continue
        cells = " ".join(f"{s['step']}:{_mean(s):.5f}/{s.get('participants')}{'' if s.get('committed') else 'x'}"
                         for s in steps)
        print(f"  {title}: {cells}")
    print("  (step:loss/groups in the quorum; x: not committed, the group's own loss)")
    g0, spare = runs["g0-1"][0], runs["g1-2"][0]
    if not (g0 and spare):
        return None
    failed = [s for s in g0 if not s.get("committed")]
    print(f"  group 0 never stopped: {len(g0)} steps recorded, uncommitted: {[s['step'] for s in failed] or 'none'}")
    if failed:
        after = [s for s in g0 if s["t"] > failed[0]["t"] and s.get("committed")]
        if after:
            print(f"  group 0 committed again {after[0]['t'] - failed[0]['t']:.1f} s after its failed step "
                  f"(step {after[0]['step']}, time of that step {after[0]['time_s']:.1f} s incl. the quorum wait)")
    for n in (1, 2):
        times = [s["time_s"] for s in g0 if s.get("participants") == n and s.get("committed")]
        if times:
            print(f"  group 0 step time with {n} group(s) in the quorum: {sum(times) / len(times):.2f} s "
                  f"({len(times)} steps)")
    joined = [s for s in spare if s.get("committed")]
    heal = _heal_seconds(out, stack)
    if joined:
        print(f"  the spare's first committed step: {joined[0]['step']} (torchft step {joined[0]['ft_step']}); "
              f"torchft's checkpoint transfer per rank: {', '.join(f'{t:.2f} s' for t in heal) or '?'}")
        gate = os.path.join(out, f"{stack}-ft-spare.go")
        if os.path.exists(gate):
            print(f"  the spare let in -> its first step committed: {joined[0]['t'] - os.path.getmtime(gate):.1f} s "
                  f"(process group, model, Manager, quorum, heal, the step; that step {joined[0]['time_s']:.1f} s)")
    for rank in (0, 1):
        ours = {s["step"]: s["digest"] for s in (runs["g0-1"][rank] or []) if s.get("committed")}
        for name, title in (("g1-1", "group 1 before the kill"), ("g1-2", "the spare")):
            theirs = [s for s in (runs[name][rank] or []) if s.get("committed") and s["step"] in ours]
            same = {part: sum(ours[s["step"]][part] == s["digest"][part] for s in theirs)
                    for part in ("model", "optim")}
            print(f"  rank {rank}, {title}: model shards equal group 0's (SHA-256) at {same['model']}/{len(theirs)} "
                  f"common committed steps, optimizer state at {same['optim']}/{len(theirs)}")
    return {rank: {s["step"]: s for s in runs["g0-1"][rank] or []} for rank in (0, 1)}


def main():
    out = sys.argv[1]
    stacks = sys.argv[2:] or ["torch", "hp"]
    g0 = {stack: report(out, stack) for stack in stacks}
    if len(stacks) == 2 and all(g0.values()):
        for rank in (0, 1):
            a, b = (g0[s][rank] for s in stacks)
            common = [k for k in a if k in b and a[k].get("committed") and b[k].get("committed")]
            same = sum(a[k]["digest"] == b[k]["digest"] for k in common)
            print(f"group 0 rank {rank}: {stacks[0]}'s and {stacks[1]}'s model shards and optimizer state "
                  f"bit-identical (SHA-256) at {same}/{len(common)} committed steps")
        a, b = (g0[s][0] for s in stacks)
        both = [k for k in sorted(a) if k in b and a[k].get("participants") == b[k].get("participants")
                and a[k].get("committed") and b[k].get("committed")]
        print(f"group 0, {stacks[0]} vs {stacks[1]} (steps with the same quorum size, both committed):")
        worst = 0.0
        for k in both:
            rel = abs(a[k]["loss"] - b[k]["loss"]) / abs(a[k]["loss"])
            worst = max(worst, rel)
            print(f"  step {k:3d} groups {a[k]['participants']}  {_mean(a[k]):.6f}  {_mean(b[k]):.6f}  rel {rel:.1e}")
        print(f"  largest relative loss difference: {worst:.1e}")


if __name__ == "__main__":
    main()
