"""Two kernel reports side by side: every kernel of the workload, before and after (issue 12's proof).

    python bench/kernel_report_compare.py BEFORE AFTER [--out bench/results/kernel_report_before_after.md]

BEFORE and AFTER are kernel_report.csv files, or git revisions whose bench/results/kernel_report.csv is read (``git
show REV:bench/results/kernel_report.csv``). One row per (op, phase, size, dtype, kernel): the launch the runtime
picks (autotune candidates it does not pick are left out); where a kernel runs in several variants (direction,
residual) the worst of them (most registers and spills, fewest programs, slowest estimate) and the number of
launches; deterministic mode's launches on rows of their own. Kernels that exist on one side only show "-" on the
other (renamed or split kernels).
"""
from __future__ import annotations

import argparse
import csv
import io
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEY = ("op", "phase", "size", "dtype", "kernel")
SIZES = ("infer B=1", "infer B=16", "infer B=64", "train B=128", "train B=384")


def load(src: str) -> tuple[list[dict], str]:
    path = Path(src)
    if path.is_file():
        text = path.read_text()
    else:
        text = subprocess.run(["git", "show", f"{src}:bench/results/kernel_report.csv"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
    rows = [r for r in csv.DictReader(io.StringIO(text)) if r.get("chosen", "1") != "0"]
    if not rows:
        raise SystemExit(f"kernel_report_compare: no rows in {src}")
    return rows, rows[0]["commit"]


def summarise(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        k = tuple(r[c] for c in KEY)
        if r.get("variant") == "det":  # deterministic mode's launch: a row of its own
            k = k[:4] + (k[4] + " (deterministic)",)
        s = out.setdefault(k, dict(n=0, config=r["config"], programs=10**9, regs=0, spill=0, tc=0, ldgsts=0,
                                   tma=0, atom=0, us=0.0))
        s["n"] += 1
        s["programs"] = min(s["programs"], int(r["programs"]))
        s["regs"] = max(s["regs"], int(r["regs"]))
        s["spill"] = max(s["spill"], int(r["spill_st"]) + int(r["spill_ld"]))
        s["tc"] = max(s["tc"], int(r["hgmma"]) + int(r["hmma"]))
        s["ldgsts"] = max(s["ldgsts"], int(r["ldgsts"]))
        s["tma"] = max(s["tma"], int(r["tma"]))
        s["atom"] = max(s["atom"], int(r["atom"]))
        s["us"] = max(s["us"], float(r["est_us"]))
    return out


def cells(s: dict | None) -> list[str]:
    if s is None:
        return ["-"] * 8
    return [f"{s['config']}" + (f" (x{s['n']})" if s["n"] > 1 else ""), str(s["programs"]), str(s["regs"]),
            str(s["spill"]), str(s["tc"]), str(s["ldgsts"] + s["tma"]), str(s["atom"]), f"{s['us']:g}"]


def render(before: list[dict], b_commit: str, after: list[dict], a_commit: str, cmd: str) -> str:
    b, a = summarise(before), summarise(after)
    keys = sorted(set(b) | set(a), key=lambda k: (SIZES.index(k[2]) if k[2] in SIZES else 99, k[3], k[0],
                                                    k[1], k[4]))
    head = ["config", "programs", "regs", "spill B", "TC instr", "async copies", "atomics", "est µs"]
    lines = [
        "# Kernel report, before and after (sm_90a, compiled without a GPU; every time an estimate)", "",
        f"Before: kernel_report.csv of commit `{b_commit}`; after: of commit `{a_commit}`. Command: `{cmd}`.", "",
        "One row per kernel of the workload and size: the launch the runtime picks; a kernel launched in several "
        "variants (direction, residual) shows the worst variant (most registers and spill bytes (stores + loads), "
        "fewest programs, slowest estimate) and `(xN)` launches. `TC instr` = HGMMA + HMMA in the SASS, `async "
        "copies` = LDGSTS + TMA, `atomics` = atomic instructions. Kernels on one side only (split or renamed) "
        "show `-` on the other.", ""]
    current = None
    for k in keys:
        if k[2:4] != current:
            current = k[2:4]
            lines += ["", f"## {k[2]}, {k[3]}", "",
                      "| op | phase | kernel | side | " + " | ".join(head) + " |",
                      "|" + "---|" * (4 + len(head))]
        for side, table in (("before", b), ("after", a)):
            lines.append(f"| {k[0]} | {k[1]} | {k[4]} | {side} | " + " | ".join(cells(table.get(k))) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kernel_report_before_after.md"))
    args = ap.parse_args(argv)
    before, b_commit = load(args.before)
    after, a_commit = load(args.after)
    cmd = "python bench/kernel_report_compare.py " + " ".join(argv if argv is not None else sys.argv[1:])
    Path(args.out).write_text(render(before, b_commit, after, a_commit, cmd))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
