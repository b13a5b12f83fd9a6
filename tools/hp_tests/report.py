#!/usr/bin/env python3
"""Table of HyperParallel's shard-op cases on hyper_parallel: results/<mode>.jsonl -> markdown.

python3 tools/hp_tests/report.py [--failures]   (writes results/report.md too)
"""
import argparse
import json
import pathlib

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
MODES = ("default", "strict")
NPU_ONLY = ("case_npu_fusion_attention.py", "case_npu_rms_norm.py", "case_npu_rotary_mul.py")


def load(mode):
    path = RESULTS / f"{mode}.jsonl"
    if not path.exists():
        return {}
    recs = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            recs[rec["case"]] = rec
    return recs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--failures", action="store_true", help="list every non-passing case")
    args = ap.parse_args()
    runs = {m: load(m) for m in MODES}
    lines = ["| mode | cases run | pass | fail | error | not applicable (NPU-only files) |",
             "|---|---|---|---|---|---|"]
    for m, recs in runs.items():
        n = {s: sum(r["status"] == s for r in recs.values()) for s in ("pass", "fail", "error")}
        lines.append(f"| {m} | {len(recs)} | {n['pass']} | {n['fail']} | {n['error']} | {len(NPU_ONLY)} files |")
    if args.failures:
        names = sorted({c for recs in runs.values() for c, r in recs.items() if r["status"] != "pass"})
        lines += ["", "| case | default | strict | first error | where |", "|---|---|---|---|---|"]
        for c in names:
            d, s = runs["default"].get(c, {}), runs["strict"].get(c, {})
            r = d if d.get("status", "pass") != "pass" else s
            err = r.get("error", "").replace("|", "\\|")[:220]
            lines.append(f"| {c} | {d.get('status', '-')} | {s.get('status', '-')} | {err} | {r.get('where', '')} |")
    text = "\n".join(lines)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "report.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
