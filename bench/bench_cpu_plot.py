"""Plot tokens/s against batch size for CPU embedding and CPU training (bench/results/cpu_throughput.png).

Reads the rows that ``bench_cpu_embedding.py --batch ...`` and ``bench_cpu_train.py --batch ...`` appended to
bench/results/cpu_embedding.csv and cpu_train.csv; for every (provider, batch size) the latest row is drawn.
Needs matplotlib (``.venv-allennlp/bin/python -m pip install matplotlib``).

    .venv-allennlp/bin/python bench/bench_cpu_plot.py
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PANELS = [("cpu_embedding", "sentences", "embedding (biLM forward), sentences per batch"),
          ("cpu_train", "B", "pretraining step, rows per direction (x 20 steps)")]


def latest(name: str, xkey: str) -> dict[str, dict[int, dict]]:
    """provider -> batch -> the last row written for it."""
    out: dict[str, dict[int, dict]] = {}
    with open(common.RESULTS / f"{name}.csv", newline="") as fh:
        for row in csv.DictReader(fh):
            out.setdefault(row["provider"], {})[int(row[xkey])] = row
    return out


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    commits, devices = set(), set()
    for ax, (name, xkey, title) in zip(axes, PANELS):
        for provider, rows in sorted(latest(name, xkey).items()):
            xs = sorted(rows)
            ax.plot(xs, [float(rows[x]["tokens_per_s"]) for x in xs], marker="o", label=provider)
            commits.update(rows[x]["commit"] for x in xs)
            devices.update(rows[x]["device"] for x in xs)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(title)
        ax.set_ylabel("tokens/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"original-size ELMo on the CPU, fp32 unless marked\n"
                 f"{'; '.join(sorted(devices))}; commit {', '.join(sorted(commits))}", fontsize=9)
    fig.tight_layout()
    path = common.RESULTS / "cpu_throughput.png"
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
