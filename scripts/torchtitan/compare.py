"""Table of a torchtitan check run: per row, torch's and hyper_parallel's losses and grad norms side by
side, the largest relative difference of each and the step-time ratio (hp / torch, steps 2..N: step 1
holds warm-up). The verdict needs both within ``TOL`` (environment, default 1e-5).

    python scripts/torchtitan/compare.py [--init load|seed] OUTDIR ROW [ROW ...]

``--init seed`` (no loaded weights; each stack initialised itself from the same ``--debug.seed``):
also compares the two stacks' initial weights (``weights-ROW.pt`` from torch, ``weights-hp-ROW.pt``
from hyper_parallel), and the verdict is on the initial weights and the step-1 loss.
"""
import json
import os
import sys

TOL = float(os.environ.get("TOL", "1e-5"))


def weights_diff(out, row):
    """(parameters compared, how many differ, largest absolute difference) of the two initial weight files."""
    import torch
    a, b = (os.path.join(out, f) for f in (f"weights-{row}.pt", f"weights-hp-{row}.pt"))
    if not (os.path.exists(a) and os.path.exists(b)):
        return None
    wa, wb = torch.load(a), torch.load(b)
    if set(wa) != set(wb):
        return len(wa), -1, float("inf")
    diffs = [float((wa[k].double() - wb[k].double()).abs().max()) if wa[k].numel() else 0.0 for k in wa]
    return len(wa), sum(d > 0 for d in diffs), max(diffs, default=0.0)


def main():
    argv = sys.argv[1:]
    init = "load"
    if argv[:1] == ["--init"]:
        init, argv = argv[1], argv[2:]
    out, rows = argv[0], argv[1:]
    print(f"{'row':<16} {'step':>4} {'torch loss':>12} {'hp loss':>12} {'rel diff':>9}   "
          f"{'torch gnorm':>11} {'hp gnorm':>11} {'rel diff':>9}")
    summary = []
    for row in rows:
        paths = [os.path.join(out, f"{s}-{row}.json") for s in ("torch", "hp")]
        if not all(os.path.exists(p) for p in paths):
            which = [s for s, p in zip(("torch", "hp"), paths) if not os.path.exists(p)]
            summary.append((row, None, None, None, f"FAILED ({', '.join(which)}: see {out}/<stack>-{row}.log)"))
            continue
        a, b = (json.load(open(p)) for p in paths)
        worst = gworst = 0.0
        hp_steps = {s["step"]: s for s in b["steps"]}
        a["steps"] = [s for s in a["steps"] if s["step"] in hp_steps]  # (a resumed run starts later)
        b["steps"] = [hp_steps[s["step"]] for s in a["steps"]]
        for x, y in zip(a["steps"], b["steps"]):
            r = abs(x["loss"] - y["loss"]) / abs(x["loss"])
            g = abs(x["grad_norm"] - y["grad_norm"]) / abs(x["grad_norm"])
            worst, gworst = max(worst, r), max(gworst, g)
            print(f"{row:<16} {x['step']:>4} {x['loss']:>12.7f} {y['loss']:>12.7f} {r:>9.1e}   "
                  f"{x['grad_norm']:>11.6f} {y['grad_norm']:>11.6f} {g:>9.1e}")
        if len(a["steps"]) != len(hp_steps) or not a["steps"]:
            summary.append((row, worst, gworst, None, f"FAILED (steps: torch {len(a['steps'])}, hp {len(hp_steps)})"))
            continue
        ta = sum(s["time_s"] for s in a["steps"][1:]) or float("nan")
        tb = sum(s["time_s"] for s in b["steps"][1:])
        if init == "seed":
            wd = weights_diff(out, row)
            first = abs(a["steps"][0]["loss"] - b["steps"][0]["loss"]) / abs(a["steps"][0]["loss"])
            if wd is None:
                verdict = "FAILED (initial weight files missing)"
            else:
                n, ndiff, mx = wd
                verdict = (f"{'match' if ndiff == 0 and first <= TOL else 'DIFFERS'} (initial weights: {n - ndiff}"
                           f"/{n} equal, max abs diff {mx:.1e}; step-1 loss rel diff {first:.1e})")
            summary.append((row, worst, gworst, tb / ta, verdict))
            continue
        summary.append((row, worst, gworst, tb / ta, "match" if max(worst, gworst) <= TOL else "DIFFERS"))
    print()
    print(f"{'row':<16} {'loss rel diff':>13} {'gnorm rel diff':>14} {'time hp/torch':>13}  "
          f"result (tolerance {TOL:g})")
    for row, worst, gworst, ratio, verdict in summary:
        w = "-" if worst is None else f"{worst:.1e}"
        gw = "-" if gworst is None else f"{gworst:.1e}"
        t = "-" if ratio is None else f"{ratio:.2f}"
        print(f"{row:<16} {w:>13} {gw:>14} {t:>13}  {verdict}")


if __name__ == "__main__":
    main()
