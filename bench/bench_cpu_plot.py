"""Plot tokens/s against batch size for CPU embedding and CPU training (bench/results/cpu_throughput.png).

Reads the rows that ``bench_cpu_embedding.py --batch ...`` and ``bench_cpu_train.py --batch ...`` appended to
bench/results/cpu_embedding.csv and cpu_train.csv; for every (provider, batch size) the latest row of one device is
drawn (``--device``: a substring of the CSV's device column; default the device of cpu_train.csv's last row), so
machines are never mixed in one figure. Providers timed with an ``ELMO_FAST_*`` switch (``--variant``) are left out
unless ``--variants``. Needs matplotlib (``.venv-allennlp/bin/python -m pip install matplotlib``).

    .venv-allennlp/bin/python bench/bench_cpu_plot.py [--device EPYC] [--out cpu_throughput_epyc.png]
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PANELS = [("cpu_embedding", "sentences", "embedding (biLM forward), sentences per batch"),
          ("cpu_train", "B", "pretraining step, rows per direction (x 20 steps)")]


def rows_of(name: str) -> list[dict]:
    with open(common.RESULTS / f"{name}.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def latest(rows: list[dict], xkey: str, device: str, variants: bool = False) -> dict[str, dict[int, dict]]:
    """provider -> batch -> the last row written for it on a device whose name contains ``device``."""
    out: dict[str, dict[int, dict]] = {}
    for row in rows:
        if device in row["device"] and (variants or "[" not in row["provider"]):
            out.setdefault(row["provider"], {})[int(row[xkey])] = row
    return out


def provenance(rows: list[dict]) -> dict[str, str]:
    """Where the drawn rows come from: device, torch, commit, date range and commands (each distinct value once)."""
    def distinct(key):
        return ", ".join(sorted({r[key] for r in rows}))

    dates = sorted(r["date"] for r in rows)
    return {"device": distinct("device"), "torch": distinct("torch"), "commit": distinct("commit"),
            "date": dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}",
            "command": " | ".join(sorted({r["command"] for r in rows}))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", help="substring of the device column (default: the device of the last train row)")
    ap.add_argument("--out", default="cpu_throughput.png", help="file name under bench/results/")
    ap.add_argument("--variants", action="store_true", help="also draw providers timed with an ELMO_FAST_* switch")
    args = ap.parse_args(argv)
    data = {name: rows_of(name) for name, _, _ in PANELS}
    device = args.device if args.device is not None else data["cpu_train"][-1]["device"]
    picked = {name: latest(data[name], xkey, device, args.variants) for name, xkey, _ in PANELS}
    if not all(picked.values()):
        empty = [name for name, v in picked.items() if not v]
        raise SystemExit(f"no rows for a device matching {device!r} in {', '.join(empty)} "
                         f"(devices there: {sorted({r['device'] for n in empty for r in data[n]})})")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    used = []  # every CSV row drawn
    for ax, (name, _, title) in zip(axes, PANELS):
        for provider, rows in sorted(picked[name].items()):
            xs = sorted(rows)
            ax.plot(xs, [float(rows[x]["tokens_per_s"]) for x in xs], marker="o", label=provider)
            used += [rows[x] for x in xs]
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(title)
        ax.set_ylabel("tokens/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    facts = provenance(used)
    fig.suptitle(f"original-size ELMo on the CPU, fp32 unless marked\ndevice: {facts['device']}", fontsize=9)
    fig.text(0.5, 0.01, f"torch {facts['torch']}; commit {facts['commit']}; measured {facts['date']}; "
             f"commands: {facts['command']}", ha="center", va="bottom", fontsize=6.5, wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path = common.RESULTS / args.out
    # the same facts in the PNG's text chunks, for tools that read the file without looking at it
    fig.savefig(path, dpi=110, metadata={"Title": "elmo_fast CPU throughput against batch size",
                                         "Description": "; ".join(f"{k}: {v}" for k, v in facts.items()),
                                         "Source": "bench/bench_cpu_plot.py"})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
