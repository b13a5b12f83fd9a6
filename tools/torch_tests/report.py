#!/usr/bin/env python3
"""Table of per-test results: torch (orig) vs hyper_parallel (hp = torch DeviceMesh imports kept,
hp_mesh = DeviceMesh/init_device_mesh from hyper_parallel too).

python report.py [--md] [--errors-for hp|hp_mesh] [--only-failing]
Statuses: PASS, FAIL, ERROR, SKIP, XFAIL (expected failure that failed = ok), XPASS (unexpected
success = counted as not ok, like pytest), TIMEOUT (file killed; from the -v log), '-' (not run:
deselected because EXCLUDED, or the variant was not run).
"ok" = PASS or XFAIL.
"""
import argparse
import pathlib
import re
import xml.etree.ElementTree as ET

import excluded

ROOT = pathlib.Path(__file__).resolve().parent
FILES = ["test_dtensor.py", "test_redistribute.py", "test_api.py",
         "parallel/test_tp_style.py", "parallel/test_parallelize_api.py"]
VARIANTS = ["orig", "hp", "hp_mesh"]
OK = {"PASS", "XFAIL"}
BAD = {"FAIL", "ERROR", "XPASS", "TIMEOUT", "SKIP"}

EXC_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Warning|Interrupt|Exit)|AssertionError|Failed|Unexpected success)\b")
NOISE = re.compile(r"exited with error code|Exception in worker process|To execute this test")


def first_error_line(text):
    """The most specific exception line of a (possibly multi-process) failure, plus the test-file
    line it came from."""
    if not text:
        return ""
    lines = [re.sub(r"^E\s{1,}", "", l.rstrip()) for l in text.splitlines()]
    lines = [re.sub(r"^\s*\[rank\d+\]:?\s*", "", l) for l in lines]
    where = ""
    for l in lines:
        m = re.search(r'File "[^"]*/(?:orig|hp|hp_mesh)/([^"]+)", line (\d+), in (\w+)', l)
        if m:
            where = f"  [{m.group(1)}:{m.group(2)}]"
    lines = [re.sub(r"\x1b\[[0-9;]*m|#x1B\[[0-9;]*m", "", l) for l in lines]
    idx = [i for i, l in enumerate(lines) if EXC_LINE.match(l) and not NOISE.search(l)]
    if idx:
        i = idx[-1]
        msg = lines[i].strip()
        detail = [l.strip() for l in lines[i + 1:i + 6] if re.match(r"\s*(Expected .* but got|WeightsUnpickler error)", l)]
        if not detail:
            detail = [l.strip() for l in lines if "WeightsUnpickler error" in l][:1]
        if detail:
            msg = msg.split(". ")[0] + ". " + detail[0]
        return msg[:260] + where
    for l in lines:
        if l.strip():
            return l.strip()[:220] + where
    return ""


def parse_xml(path):
    res = {}
    tree = ET.parse(path)
    for tc in tree.iter("testcase"):
        parts = tc.get("classname", "").split(".")
        cls, file = parts[-1], "/".join(parts[:-1]) + ".py"
        tid = f"{file}::{cls}::{tc.get('name')}"
        status, msg = "PASS", ""
        for child in tc:
            if child.tag == "failure":
                status = "FAIL"
                msg = first_error_line((child.get("message") or "") + "\n" + (child.text or ""))
                if "Unexpected success" in (child.get("message") or "") + (child.text or ""):
                    status, msg = "XPASS", "unexpected success of an expectedFailure test"
            elif child.tag == "error":
                status = "ERROR"
                msg = first_error_line((child.get("message") or "") + "\n" + (child.text or ""))
            elif child.tag == "skipped":
                typ = child.get("type") or ""
                status = "XFAIL" if "xfail" in typ else "SKIP"
                msg = (child.get("message") or "")[:200]
        res[tid] = (status, msg)
    return res


def parse_log(path, file):
    res = {}
    for line in path.read_text(errors="replace").splitlines():
        m = re.match(r"^(\S+::\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", line)
        if m:
            st = {"PASSED": "PASS", "FAILED": "FAIL", "SKIPPED": "SKIP"}.get(m.group(2), m.group(2))
            res[m.group(1)] = (st, "(from log)")
        else:
            m = re.match(r"^(\S+::\S+::\S+) ", line)
            if m and m.group(1) not in res:
                res[m.group(1)] = ("TIMEOUT", "file run killed before this test finished")
    return res


def load(variant):
    """All results/<variant>/*.xml (later files override earlier ones, so a re-run of a single
    test wins); a .log without a fresh .xml next to it (file killed by timeout) is parsed instead."""
    res = {}
    d = ROOT / "results" / variant
    if not d.exists():
        return res
    for x in sorted(d.glob("*.xml"), key=lambda p: p.stat().st_mtime):
        lg = x.with_suffix(".log")
        if lg.exists() and x.stat().st_mtime < lg.stat().st_mtime - 5:
            res.update(parse_log(lg, None))
            continue
        try:
            res.update(parse_xml(x))
        except ET.ParseError:
            if lg.exists():
                res.update(parse_log(lg, None))
    for lg in d.glob("*.log"):
        if not lg.with_suffix(".xml").exists():
            res.update(parse_log(lg, None))
    return res


def collected_ids():
    ids = set()
    p = ROOT / "collected.txt"
    if p.exists():
        ids = {l.strip() for l in p.read_text().splitlines() if "::" in l}
    return ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--md", action="store_true")
    ap.add_argument("--non-excluded", action="store_true", help="only the non-excluded rows")
    ap.add_argument("--excluded-list", action="store_true", help="print excluded ids with reasons and exit")
    ap.add_argument("--only-failing", action="store_true", help="rows where hp or hp_mesh is not ok (non-excluded)")
    args = ap.parse_args()
    data = {v: load(v) for v in VARIANTS}
    if args.excluded_list:
        for t in sorted(collected_ids()):
            why = excluded.reason(t)
            if why and "WithLocalTensor" not in t:
                print(f"* `{t}` — {why}" if args.md else f"{t}  {why}")
        return
    ids = collected_ids() | set().union(*[set(d) for d in data.values()])
    order = {f: i for i, f in enumerate(FILES)}
    ids = sorted(ids, key=lambda t: (order.get(t.split("::")[0], 99), t))
    rows = []
    for t in ids:
        why = excluded.reason(t)
        st = [data[v].get(t, ("-", ""))[0] for v in VARIANTS]
        err_hp = data["hp"].get(t, ("-", ""))[1] if st[1] not in OK | {"-", "SKIP"} else ""
        err_mesh = data["hp_mesh"].get(t, ("-", ""))[1] if st[2] not in OK | {"-", "SKIP"} else ""
        rows.append((t, *st, "EXCL" if why else "", err_hp, err_mesh))
    sep = " | " if args.md else "  "
    if args.md:
        print("| test | torch | hp | hp_mesh | excl | first error line (hp; hp_mesh if different) |")
        print("|---|---|---|---|---|---|")
    for t, a, b, c, e, eh, em in rows:
        if args.only_failing and (e or not ({b, c} & BAD)):
            continue
        if args.non_excluded and e:
            continue
        err = eh if (not em or em == eh) else (f"{eh} || hp_mesh: {em}" if eh else f"hp_mesh: {em}")
        err = err.replace("|", "\\|") if args.md else err
        if args.md:
            print(f"| {t} | {a} | {b} | {c} | {e} | {err} |")
        else:
            print(f"{t:<95}{a:<8}{b:<8}{c:<8}{e:<5}{err}")
    ne = [r for r in rows if not r[4]]
    print()
    print(f"non-excluded tests: {len(ne)}   (excluded: {len(rows) - len(ne)}, of which LocalTensor variants: "
          f"{sum(1 for r in rows if r[4] and 'WithLocalTensor' in r[0])})")
    for i, v in enumerate(VARIANTS):
        col = [r[1 + i] for r in ne]
        counts = {s: col.count(s) for s in sorted(set(col))}
        print(f"  {v:<8} ok(PASS+XFAIL)={sum(col.count(s) for s in OK):>3}  " + "  ".join(f"{k}={n}" for k, n in counts.items()))


if __name__ == "__main__":
    main()
