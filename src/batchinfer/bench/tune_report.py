"""What `batchinfer tune` writes from its runs: the summary, the table, the winner's config
file, the plots, and the table printed at the end (`bench.tune` does the search)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from batchinfer.bench.tune import Candidate, TuneConfig, Tuner


def write_outputs(tuner: Tuner, best: Candidate | None, command: str | None
                  ) -> dict[str, Path]:
    """Every point as `summary.json` and `table.md`, the winner as `best-config.yaml` (with
    `command`, its `batchinfer serve` line), and the plots; their paths by kind."""
    config, out = tuner.config, tuner.dir
    rows = []
    for candidate in tuner.candidates.values():
        for point in candidate.points.values():
            if not point.runs:
                continue
            complete = len(point.runs) >= config.repeats
            ok = complete and tuner.judge(point)[0]
            rows.append({"config": candidate.key, "rate": point.rate, "runs": len(point.runs),
                         "ok": ok, "complete": complete, "batch_size": point.median("batch_size"),
                         "goodput": point.median("goodput"),
                         "output_throughput": point.median("output_throughput"),
                         **{k: point.median(k) for k in config.slo},
                         **{f"{k}_spread": point.spread(k) for k in config.slo}})
    summary = {
        "slo": config.slo, "workload": {"input": config.input_len, "output": config.output_len},
        "rates": list(tuner.rates), "repeats": config.repeats, "margin": config.margin,
        "configs": [{"config": c.key, "knobs": c.knobs, "score_rate": c.score,
                     "goodput": c.goodput, "failure": c.failure}
                    for c in tuner.candidates.values()],
        "points": rows,
        "best": None if best is None else {"knobs": best.knobs, "rate": best.score,
                                           "command": command},
    }
    paths = {"summary": out / "summary.json", "table": out / "table.md"}
    paths["summary"].write_text(json.dumps(summary, indent=2) + "\n")
    paths["table"].write_text(markdown_table(config, rows))
    stale = out / "best-config.yaml"
    if best is not None:
        paths["config"] = stale
        paths["config"].write_text(best_config_yaml(config, best.knobs))
    elif stale.exists():
        stale.unlink()  # an earlier tune's winner must not pass for this one's
    paths.update(plot(tuner, rows, out))
    return paths


def markdown_table(config: TuneConfig, rows: list[dict[str, Any]]) -> str:
    keys = list(config.slo)
    head = ["configuration", "rate (req/s)", "runs", "seqs/step", *keys, "goodput", "SLO"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["config"], f"{row['rate']:g}", str(row["runs"]),
                 _fmt(row["batch_size"], ".1f"),
                 *(f"{_fmt(row[k], '.0f')} ms ±{100 * row[f'{k}_spread']:.0f}%" for k in keys),
                 _fmt(row["goodput"], ".2f"),
                 "ok" if row["ok"] else "over" if row["complete"] else "incomplete"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def best_config_yaml(config: TuneConfig, knobs: dict[str, Any]) -> str:
    """The winner as `batchinfer serve --config` reads it: flag names to values."""
    import yaml  # type: ignore[import-untyped]

    data = {k.replace("_", "-"): v for k, v in {**config.engine, **knobs}.items()}
    slo = ", ".join(f"{k} <= {v:g} ms" for k, v in config.slo.items())
    header = (f"# batchinfer tune: best configuration for {slo}\n"
              f"# batchinfer serve --config {Path(config.result_dir) / 'best-config.yaml'}\n")
    return header + yaml.safe_dump(data, sort_keys=False)


def plot(tuner: Tuner, rows: list[dict[str, Any]], out: Path) -> dict[str, Path]:
    from matplotlib.figure import Figure

    if not rows:
        return {}
    paths: dict[str, Path] = {}
    figure = Figure(figsize=(8, 5), layout="constrained")
    ax = figure.subplots()
    for key in dict.fromkeys(r["config"] for r in rows):
        points = [r for r in rows if r["config"] == key and r["goodput"] is not None]
        if points:
            ax.plot([p["rate"] for p in points], [p["goodput"] for p in points], "o-",
                    label=key)
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("goodput (req/s meeting every SLO)")
    ax.set_title("Goodput vs rate per configuration")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    paths["goodput_plot"] = out / "goodput-vs-rate.png"
    figure.savefig(paths["goodput_plot"], dpi=110)

    figure = Figure(figsize=(11, 4.5), layout="constrained")
    axes = figure.subplots(1, 2)
    runs = list(tuner.done.values())
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        xs = [r["batch_size"] for r in runs if r.get("batch_size") and r.get(f"{metric}_p99")]
        ys = [r[f"{metric}_p99"] for r in runs if r.get("batch_size") and r.get(f"{metric}_p99")]
        ax.scatter(xs, ys, s=18)
        for key, limit in tuner.config.slo.items():
            if key.startswith(metric):
                ax.axhline(limit, color="#d3455b", linestyle="--", label=f"SLO {key} {limit:g} ms")
        ax.set_xlabel("sequences per step (server-side, mean of a run)")
        ax.set_ylabel(f"{metric.upper()} p99 (ms)")
        ax.set_title(f"{metric.upper()} p99 vs real batch size")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    paths["latency_plot"] = out / "latency-vs-batch.png"
    figure.savefig(paths["latency_plot"], dpi=110)
    return paths


def print_table(console: Console, tuner: Tuner, best: Candidate | None) -> None:
    table = Table(title="batchinfer tune: every configuration tried")
    for column in ("configuration", "best rate meeting the SLO", "goodput", "stopped by"):
        table.add_column(column, justify="left" if column == "configuration" else "right",
                         overflow="fold")
    for c in tuner.candidates.values():
        mark = " [bold green]<- best[/bold green]" if best is not None and c is best else ""
        table.add_row(c.key + mark, f"{c.score:g} req/s" if c.score else "none",
                      f"{c.goodput:.2f}", c.failure or "")
    console.print(table)
