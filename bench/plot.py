#!/usr/bin/python3
"""Draws bus bandwidth and time against message size, log-scaled, one curve per run, into one image.

usage: bench/plot.py OUTPUT.svg|OUTPUT.png INPUT [INPUT...] [--title TEXT]
  INPUT: a weft-bench --json file (each placement and transport is its own curve, labelled with the
         transport, ranks and host it recorded; --overlap runs draw t_pure and t_ovrl), or a CSV with the
         columns label,bytes,time_us,busbw (bench/compare.sh writes one for every implementation it ran).
Debian: apt-get install python3-matplotlib (this script runs Debian's /usr/bin/python3)."""
import csv
import json
import os
import sys

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit("bench/plot.py: matplotlib is missing (Debian: apt-get install python3-matplotlib)")


def size_label(b):
    for unit, n in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= n:
            return f"{b / n:g}{unit}"
    return f"{b:g}"


def curves_of(path):
    """{label: [(bytes, time_us, busbw or None)]} from one input file."""
    curves = {}
    if path.endswith(".json"):
        with open(path) as f:
            records = json.load(f)
        for r in records:
            base = f"weft {r.get('collective', '')} {r.get('transport', '?')}, {r.get('ranks', '?')} ranks"
            if r.get("host"):
                base += f" @{r['host']}"
            if r.get("awaited"):
                base += ", awaited"
            if r.get("overlap"):
                curves.setdefault(base + ", t_pure", []).append((r["bytes"], r["t_pure_us"], None))
                curves.setdefault(base + ", t_ovrl (with compute)", []).append((r["bytes"], r["t_ovrl_us"], None))
            else:
                label = base + (", in place" if r.get("inplace") else "")
                curves.setdefault(label, []).append((r["bytes"], r["time_us"], r.get("busbw")))
    else:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                busbw = row.get("busbw")
                curves.setdefault(row["label"], []).append(
                    (int(row["bytes"]), float(row["time_us"]), float(busbw) if busbw not in (None, "", "nan") else None))
    return curves


def main(argv):
    title = None
    if "--title" in argv:
        i = argv.index("--title")
        title = argv[i + 1]
        del argv[i:i + 2]
    if len(argv) < 2:
        sys.exit(__doc__)
    output, inputs = argv[0], argv[1:]
    if not output.endswith((".svg", ".png")):
        sys.exit("bench/plot.py: the output must end in .svg or .png")
    curves = {}
    for path in inputs:
        for label, points in curves_of(path).items():
            # The same label from two files (two rounds): keep them apart.
            name = label if label not in curves else f"{label} ({os.path.basename(path)})"
            curves[name] = sorted(points)
    if not curves:
        sys.exit("bench/plot.py: no records in the inputs")

    fig, (bw_ax, time_ax) = plt.subplots(1, 2, figsize=(13, 5))
    for label, points in curves.items():
        positive = [p for p in points if p[0] > 0]
        with_bw = [p for p in positive if p[2] is not None]
        if with_bw:
            bw_ax.plot([p[0] for p in with_bw], [p[2] for p in with_bw], marker="o", markersize=3, label=label)
        if positive:
            time_ax.plot([p[0] for p in positive], [p[1] for p in positive], marker="o", markersize=3, label=label)
    for ax, ylabel in ((bw_ax, "bus bandwidth (GB/s)"), (time_ax, "time per operation (us)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ticks = sorted({p[0] for pts in curves.values() for p in pts if p[0] > 0})
        if ticks:
            step = max(1, len(ticks) // 8)
            ax.set_xticks(ticks[::step])
            ax.set_xticklabels([size_label(t) for t in ticks[::step]])
    bw_ax.set_title("bus bandwidth (higher is better)")
    time_ax.set_title("time (lower is better)")
    handles, labels = time_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08 + 0.03 * ((len(labels) + 1) // 2), 1, 1))
    fig.savefig(output)
    print(f"bench/plot.py: wrote {output} ({len(curves)} curves)")


if __name__ == "__main__":
    main(sys.argv[1:])
