#!/usr/bin/env python3
"""Tabulate (and plot, when matplotlib is installed) the runs of validation/first_evidence.sh.

usage: validation/evidence.py RUN_DIR [--png OUT.png]
Reads RUN_DIR/<name>/log.jsonl for each run; prints a markdown table of the final validation loss
and its gap to the mean BF16 validation loss, the mean and spread of runs that differ only in the
seed (<name>_s1, <name>_s2, ...), the gap at every evaluation and the last quantization
statistics, and writes RUN_DIR/evidence.md (and the PNG).
"""
import json
import os
import sys


def load(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    run_dir = sys.argv[1]
    png = sys.argv[sys.argv.index("--png") + 1] if "--png" in sys.argv else os.path.join(run_dir, "evidence.png")
    runs = {}
    for name in sorted(os.listdir(run_dir)):
        log = os.path.join(run_dir, name, "log.jsonl")
        if os.path.isfile(log):
            runs[name] = load(log)
    if not runs:
        print(f"evidence: no runs under {run_dir}")
        return 1
    final = {}
    for name, rows in runs.items():
        vals = [r for r in rows if "val_loss" in r]
        if vals:
            final[name] = (vals[-1]["step"], vals[-1]["val_loss"], rows[-1]["loss"],
                           sum(r["tok_per_s"] for r in rows[2:]) / max(1, len(rows) - 2))
    bf16 = [v[1] for k, v in final.items() if k.startswith("bf16")]
    ref = sum(bf16) / len(bf16) if bf16 else None
    lines = ["| run | steps | final val loss | gap to BF16 (mean of seeds) | last train loss | tokens/s |",
             "|---|---|---|---|---|---|"]
    for name, (step, vl, tl, tps) in final.items():
        gap = f"{100 * (vl - ref) / ref:+.2f}%" if ref else "n/a"
        lines.append(f"| {name} | {step} | {vl:.4f} | {gap} | {tl:.4f} | {tps:,.0f} |")
    # runs that differ only in the seed (name_s1, name_s2, ...): their mean and spread, the number
    # to hold against a target such as "within 2% of BF16"
    groups = {}
    for name, v in final.items():
        base, sep, seed = name.rpartition("_s")
        if sep and seed.isdigit():
            groups.setdefault(base, []).append(v[1])
    seeded = {k: g for k, g in groups.items() if len(g) > 1}
    if seeded and ref:
        lines += ["", "| recipe | seeds | mean final val loss | gap of the mean to BF16 | seed spread (max - min) |",
                  "|---|---|---|---|---|"]
        for base, g in sorted(seeded.items()):
            mean = sum(g) / len(g)
            lines.append(f"| {base} | {len(g)} | {mean:.4f} | {100 * (mean - ref) / ref:+.2f}% | "
                         f"{100 * (max(g) - min(g)) / mean:.2f}% |")
    # seed-paired gaps: <recipe>_sK against bf16_sK (same seed: same initialisation and batches), so
    # the seed's own effect cancels; the spread of the pairs says whether a gap is resolved
    pairs = {}
    for name, v in final.items():
        base, sep, seed = name.rpartition("_s")
        if sep and seed.isdigit() and base != "bf16" and f"bf16_s{seed}" in final:
            b = final[f"bf16_s{seed}"][1]
            pairs.setdefault(base, []).append((int(seed), 100 * (v[1] - b) / b))
    if pairs:
        lines += ["", "| recipe | seed-paired gaps to BF16 (seed: gap) | mean | min .. max |",
                  "|---|---|---|---|"]
        for base, g in sorted(pairs.items()):
            gs = [x for _, x in sorted(g)]
            lines.append(f"| {base} | " + ", ".join(f"s{k}: {x:+.2f}%" for k, x in sorted(g)) +
                         f" | {sum(gs) / len(gs):+.2f}% | {min(gs):+.2f}% .. {max(gs):+.2f}% |")
    # the gap at every evaluation (against the BF16 seeds' mean at the same step): where it opens
    evals = {name: {r["step"]: r["val_loss"] for r in rows if "val_loss" in r} for name, rows in runs.items()}
    bf16_runs = [n for n in evals if n.startswith("bf16")]
    steps = sorted(set.intersection(*(set(e) for e in evals.values()))) if evals else []
    if bf16_runs and steps:
        lines += ["", "| run | " + " | ".join(f"gap @{st}" for st in steps) + " |",
                  "|---|" + "---|" * len(steps)]
        for name, e in evals.items():
            cells = []
            for st in steps:
                r = sum(evals[b][st] for b in bf16_runs) / len(bf16_runs)
                cells.append(f"{100 * (e[st] - r) / r:+.2f}%")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    # where 4 bits hurt: the last quant_stats line of each run (recipe.stats_every), per tensor role
    # (fprop.x activations, fprop.w weights, dgrad.dy gradients, ...), averaged over the layers
    stats_lines = []
    for name, rows in runs.items():
        logged = [r for r in rows if "quant_stats" in r]
        if not logged:
            continue
        by_role = {}
        for tensor, q in logged[-1]["quant_stats"].items():
            by_role.setdefault(".".join(tensor.split(".")[-2:]), []).append(q)
        for role, qs in sorted(by_role.items()):
            n = len(qs)
            stats_lines.append(f"| {name} | {logged[-1]['step']} | {role} | {n} | "
                               f"{sum(q['rel_error'] for q in qs) / n:.4f} | "
                               f"{100 * sum(q['saturated'] for q in qs) / n:.2f}% | "
                               f"{100 * sum(q['underflow_blocks'] for q in qs) / n:.3f}% |")
    if stats_lines:
        lines += ["", "| run | step | tensor role | tensors | mean rel. error | mean saturated | "
                  "mean underflowed blocks |", "|---|---|---|---|---|---|---|"] + stats_lines
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(run_dir, "evidence.md"), "w") as f:
        f.write(table + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("evidence: matplotlib not installed, no plot")
        return 0
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in runs.items():
        ax1.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=name, linewidth=0.8)
        vals = [r for r in rows if "val_loss" in r]
        ax2.plot([r["step"] for r in vals], [r["val_loss"] for r in vals], marker="o", label=name)
    ax1.set_title("training loss")
    ax2.set_title("validation loss")
    for ax in (ax1, ax2):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"evidence: plot {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
