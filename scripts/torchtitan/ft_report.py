"""Losses of the fault-tolerance row of scripts/torchtitan_check.sh, per stack, replica group and life
(group 1's first life dies after FT_DIE steps; its second life heals from group 0 and goes on).

    python scripts/torchtitan/ft_report.py OUTDIR
"""
import json
import os
import sys


def main():
    out = sys.argv[1]
    for stack in ("torch", "hp"):
        runs = {}
        for name in ("g0-1", "g1-1", "g1-2"):
            path = os.path.join(out, f"{stack}-ft-{name}.json")
            runs[name] = json.load(open(path))["steps"] if os.path.exists(path) else None
        print(f"{stack}:")
        for name, steps in runs.items():
            if steps is None:
                print(f"  {name}: no record (see {out}/{stack}-ft-{name}.log)")
                continue
            losses = " ".join(f"{s['step']}:{s['loss']:.5f}" for s in steps)
            print(f"  {name}: steps {steps[0]['step'] if steps else '-'}..{steps[-1]['step'] if steps else '-'}  {losses}")
        g0, healed = runs["g0-1"], runs["g1-2"]
        if g0 and healed:
            common = {s["step"]: s for s in g0}
            same = [s["step"] for s in healed if s["step"] in common and s["loss"] == common[s["step"]]["loss"]]
            print(f"  healed group 1 starts at step {healed[0]['step']}; steps where both groups report the same "
                  f"loss: {len(same)}/{len(healed)}")


if __name__ == "__main__":
    main()
