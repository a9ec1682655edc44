"""Write an experiment's results: CSV rows, JSON, matplotlib figures and a markdown
report that puts our figures beside the paper's (§7)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from evals.experiments import PAPER, ExperimentResult


def _fmt(x: Any, pct: bool = False) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        if math.isinf(x):
            return "inf"
        return f"{x:.0%}" if pct else f"{x:.2f}"
    return str(x)


def _times(x: float | None) -> str:
    """A ratio as ``2.08x``, ``inf`` or ``-`` (none)."""
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:.2f}x"


def write_rows(rows: list[dict], path: Path) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


# --------------------------------------------------------------------------- figures


def _plots(res: ExperimentResult, out: Path) -> list[str]:
    # Imported here: matplotlib is the `eval` extra's, and the Agg backend must be chosen
    # before pyplot loads.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)

    if res.name in ("e2e", "multi-node"):
        for w in sorted({r["workload"] for r in res.rows}):
            fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
            for s in sorted({r["system"] for r in res.rows}):
                rs = sorted((r for r in res.rows if r["workload"] == w and r["system"] == s),
                            key=lambda r: r["rate"])
                x = [r["rate"] for r in rs]
                axes[0].plot(x, [r["input_token_latency_s"] * 1e3 for r in rs], marker="o", label=s)
                axes[1].plot(x, [r["output_token_latency_s"] * 1e3 for r in rs], marker="o", label=s)
                axes[2].plot(x, [r["slo_attainment"] for r in rs], marker="o", label=s)
            for ax, title in zip(axes, ("input token latency (ms/token)", "output token latency (ms)",
                                        "SLO attainment")):
                ax.set_xlabel("request rate (req/s)")
                ax.set_title(f"{w}: {title}")
                ax.set_xscale("log", base=2)
            axes[0].set_yscale("log")
            axes[1].set_yscale("log")
            axes[2].axhline(0.9, color="grey", lw=0.8, ls="--")
            axes[2].legend(fontsize=8)
            save(fig, f"{res.name}_{w}.png")
    elif res.name == "load-balance":
        fig, ax = plt.subplots(figsize=(8, 3.6))
        for s, ser in res.series.items():
            t = [i * ser["window_s"] for i in range(len(ser["cv"]))]
            ax.plot(t, ser["cv"], label=f"{s} (mean {_fmt(res.summary['mean_cv'][s], True)})")
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("CV of per-instance cache accesses")
        ax.legend(fontsize=8)
        save(fig, "load_balance_cv.png")
    elif res.name in ("hit-rate", "elasticity"):
        key, label = (("hit_rate", "hit rate") if res.name == "hit-rate"
                      else ("input_token_latency_s", "input token latency (s/token)"))
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for s in sorted({r["system"] for r in res.rows}):
            rs = sorted((r for r in res.rows if r["system"] == s), key=lambda r: r["cache_gb"])
            ax.plot([r["cache_gb"] for r in rs], [r[key] for r in rs], marker="o", label=s)
        ax.set_xlabel("KV cache per instance (GB)")
        ax.set_ylabel(label)
        if res.name == "elasticity":
            ax.set_yscale("log")
        ax.legend(fontsize=8)
        save(fig, f"{res.name.replace('-', '_')}.png")
    return files


# --------------------------------------------------------------------------- markdown


def warnings(res: ExperimentResult) -> list[str]:
    """What makes ``res``'s ratios incomparable with the paper's: a scale below 1, or a
    rate grid that saturates (every system meets the SLO at the highest rate tried, so
    no P90 goodput and no ratio is known)."""
    out = []
    scale = res.config.get("scale")
    if scale is not None and scale < 1:
        out.append(f"scale {scale} < 1: requests and contexts are shrunk, so latencies, hit "
                   "rates and ratios cannot be compared with the paper's.")
    if res.name in ("e2e", "multi-node"):
        for w, good in res.summary.get("p90_goodput", {}).items():
            top = max((r["rate"] for r in res.rows if r["workload"] == w), default=None)
            if top is not None and good and all(g is not None and g >= top for g in good.values()):
                out.append(f"{w}: every system met the SLO at the highest rate tried ({top} "
                           "req/s): the grid saturates; "
                           "give higher --rates: the P90 goodputs are only lower bounds and their ratios mean nothing.")
    return out


def _report(res: ExperimentResult, figures: list[str]) -> str:
    lines = [f"# Experiment `{res.name}`", "",
             "Simulated (evals/sim): the real TokenLake control plane and scheduling "
             "policies, modelled compute and transfer times. Setup: "
             f"`{json.dumps(res.config.get('sim', {}), sort_keys=True)}`, scale "
             f"{res.config.get('scale')}, seed {res.config.get('seed')}"
             + (f", LooGLE document skew Zipf {res.config['zipf']}" if res.config.get("zipf") else "")
             + ".", ""]
    lines += [f"> **Warning:** {w}" for w in warnings(res)] + ([""] if warnings(res) else [])
    s = res.summary
    if res.name in ("e2e", "multi-node"):
        lines += ["## P90 goodput (req/s) and TokenLake's ratio", "",
                  "| workload | system | P90 goodput | TokenLake / system | paper |", "|---|---|---|---|---|"]
        for w, good in s["p90_goodput"].items():
            for sys_, g in good.items():
                ratio = s["p90_goodput_ratio"].get(w, {}).get(sys_)
                paper = PAPER["p90_goodput_ratio"].get(w, {}).get(sys_)
                lines.append(f"| {w} | {sys_} | {_fmt(g)} | {_times(ratio)} | {_times(paper)} |")
        lines += ["", "`inf`: the baseline met the 90% SLO at none of the rates tried. A system "
                  "that met it at the highest rate tried has a P90 goodput of at least that rate.", ""]
        lines += _knee_table(s.get("at_knee", {}))
    if res.name == "load-balance":
        lines += ["## Mean CV of per-instance cache accesses", "", "| system | ours | paper |", "|---|---|---|"]
        for sys_, cv in s["mean_cv"].items():
            lines.append(f"| {sys_} | {_fmt(cv, True)} | {_fmt(PAPER['mean_cv'].get(sys_), True)} |")
        lines.append("")
    if res.name == "hit-rate":
        systems = list(next(iter(s["hit_rate"].values())))
        lines += ["## Hit rate by cache size", "", "| GB per instance | " + " | ".join(systems) + " |",
                  "|---" * (len(systems) + 1) + "|"]
        for gb, at in s["hit_rate"].items():
            lines.append(f"| {gb} | " + " | ".join(_fmt(at[x], True) for x in systems) + " |")
        if "counted_reuse" in s:
            lines += ["", f"Reuse counted from the trace's block ids (an unbounded cache): "
                      f"{_fmt(s['counted_reuse'], True)}; in whole pages with the last prompt "
                      f"token computed (what a pool can serve): "
                      f"{_fmt(s['counted_reuse_pages'], True)}."]
        lines += ["", "| system | TokenLake / system (range over sizes) | paper |", "|---|---|---|"]
        for sys_, (lo, hi) in s.get("hit_rate_ratio_range", {}).items():
            paper = PAPER["hit_rate_ratio"].get(sys_)
            lines.append(f"| {sys_} | {lo:.2f}-{hi:.2f}x | "
                         f"{f'{paper[0]:.2f}-{paper[1]:.2f}x' if paper else '-'} |")
        lines.append("")
    if res.name == "elasticity":
        lines += ["## Latency gains (input token latency ratios)", "",
                  "| GB | MoonCake-1P3D / TL-1P3D | MoonCake-3P1D / TL-3P1D | TL-1P3D / TL-Elastic | TL-3P1D / TL-Elastic |",
                  "|---|---|---|---|---|"]
        for gb, g in s["gain"].items():
            lines.append(f"| {gb} | {_fmt(g['pooling_1p3d'])} | {_fmt(g['pooling_3p1d'])} | "
                         f"{_fmt(g['elastic_vs_1p3d'])} | {_fmt(g['elastic_vs_3p1d'])} |")
        lines += ["", "Paper (Fig. 12): pooling 26.62-86.05x (1P3D) and 2.18-39.48x (3P1D); "
                  "elasticity up to 5.22x and 2.82x.", ""]
    if figures:
        lines += ["## Figures", ""] + [f"![{f}]({f})" for f in figures] + [""]
    lines += ["Rows of every run: `rows.csv`; everything: `results.json`.", ""]
    return "\n".join(lines)


def _knee_table(at_knee: dict) -> list[str]:
    """Each system at its own knee, and what it missed at the next rate of the grid."""
    if not at_knee:
        return []
    lines = ["## Each system at its own knee", "",
             "| workload | system | knee (req/s) | hit rate there | mean TTFT (s) | p90 TBT (ms) "
             "| next rate | SLO met there: TTFT / TBT | TBT misses waiting between batches |",
             "|---|---|---|---|---|---|---|---|---|"]
    for w, systems in at_knee.items():
        for sys_, k in systems.items():
            at, nxt = k["knee"], k["next"]
            here = (f"{_fmt(at['hit_rate'], True)} | {_fmt(at['mean_ttft_s'])} | "
                    f"{at['p90_tbt_s'] * 1e3:.1f}") if at else "- | - | -"
            there = (f"{_fmt(nxt['rate'])} | {_fmt(nxt['ttft_slo_attainment'], True)} / "
                     f"{_fmt(nxt['tbt_slo_attainment'], True)} | "
                     f"{_fmt(nxt['tbt_miss_waited'], True)}") if nxt else "- | - | -"
            lines.append(f"| {w} | {sys_} | {_fmt(k['rate']) if k['rate'] else 'none'} | {here} | {there} |")
    return lines + ["", "A system without a knee met the SLO at no rate; its next rate is the "
                    "lowest tried.", ""]


def write(res: ExperimentResult, out: Path, plots: bool = True) -> dict[str, str]:
    """Writes ``rows.csv``, ``results.json``, PNG figures and ``report.md`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    write_rows(res.rows, out / "rows.csv")
    doc = {"experiment": res.name, "summary": res.summary, "config": res.config,
           "rows": res.rows, "series": res.series}
    (out / "results.json").write_text(json.dumps(_json_safe(doc), indent=1) + "\n", encoding="utf-8")
    figures = _plots(res, out) if plots else []
    (out / "report.md").write_text(_report(res, figures), encoding="utf-8")
    return {"rows": str(out / "rows.csv"), "json": str(out / "results.json"),
            "report": str(out / "report.md"), "figures": [str(out / f) for f in figures]}
