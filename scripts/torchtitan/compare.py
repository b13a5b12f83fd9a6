"""Table of a torchtitan check run: per row, torch's and hyper_parallel's losses side by side, the
largest relative difference and the step-time ratio (hp / torch, steps 2..N: step 1 holds warm-up).

    python scripts/torchtitan/compare.py OUTDIR ROW [ROW ...]
"""
import json
import os
import sys

TOL = 1e-5


def main():
    out, rows = sys.argv[1], sys.argv[2:]
    print(f"{'row':<16} {'step':>4} {'torch loss':>12} {'hp loss':>12} {'rel diff':>9}   "
          f"{'torch gnorm':>11} {'hp gnorm':>11}")
    summary = []
    for row in rows:
        paths = [os.path.join(out, f"{s}-{row}.json") for s in ("torch", "hp")]
        if not all(os.path.exists(p) for p in paths):
            which = [s for s, p in zip(("torch", "hp"), paths) if not os.path.exists(p)]
            summary.append((row, None, None, f"FAILED ({', '.join(which)}: see {out}/<stack>-{row}.log)"))
            continue
        a, b = (json.load(open(p)) for p in paths)
        worst = 0.0
        hp_steps = {s["step"]: s for s in b["steps"]}
        a["steps"] = [s for s in a["steps"] if s["step"] in hp_steps]  # (a resumed run starts later)
        b["steps"] = [hp_steps[s["step"]] for s in a["steps"]]
        for x, y in zip(a["steps"], b["steps"]):
            r = abs(x["loss"] - y["loss"]) / abs(x["loss"])
            worst = max(worst, r)
            print(f"{row:<16} {x['step']:>4} {x['loss']:>12.7f} {y['loss']:>12.7f} {r:>9.1e}   "
                  f"{x['grad_norm']:>11.6f} {y['grad_norm']:>11.6f}")
        if len(a["steps"]) != len(hp_steps) or not a["steps"]:
            summary.append((row, worst, None, f"FAILED (steps: torch {len(a['steps'])}, hp {len(hp_steps)})"))
            continue
        ta = sum(s["time_s"] for s in a["steps"][1:]) or float("nan")
        tb = sum(s["time_s"] for s in b["steps"][1:])
        summary.append((row, worst, tb / ta, "match" if worst <= TOL else "DIFFERS"))
    print()
    print(f"{'row':<16} {'max rel diff':>12} {'time hp/torch':>13}  result (tolerance {TOL:g})")
    for row, worst, ratio, verdict in summary:
        w = "-" if worst is None else f"{worst:.1e}"
        t = "-" if ratio is None else f"{ratio:.2f}"
        print(f"{row:<16} {w:>12} {t:>13}  {verdict}")


if __name__ == "__main__":
    main()
