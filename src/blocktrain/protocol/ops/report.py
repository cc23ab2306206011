"""`blocktrain report`: a run's history (`protocol.store.history`) drawn as PNG plots and one HTML
page that shows them with a summary (no script, no external resource).

    curves.png    the training losses as labelled, the validation CE and each round's
                  participation, on one integer x axis (rounds closed, or a train run's steps)
    cost.png      the model curve against seconds and MB moved (rounds sources)
    refusals.png  refused updates by reason
    index.html    the summary table, what each plot shows, and the plots"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from blocktrain.protocol.store.history import History, Series

PLOTS = ("curves.png", "cost.png", "refusals.png")


def panels(hist: History) -> list[tuple[str, Series]]:
    """The panels of curves.png, top to bottom: (y label, labelled series), those with data."""
    participation: Series = {
        f"block {b}": [(p.round + 1, p.participation) for p in pts]
        for b, pts in sorted(hist.per_block().items())
    }
    if not participation and hist.points:  # a simulation's whole-model rounds
        participation = {
            "all blocks": [(p.round + 1, p.participation) for p in hist.points if p.block is None]
        }
    out = [
        ("training loss, as labelled (nats/byte)", hist.losses),
        ("validation CE (nats/byte)", hist.evals),
        ("participation", participation),
    ]
    return [(y, series) for y, series in out if any(series.values())]


def write_report(hist: History, out: Path) -> list[Path]:
    """Every plot that has data, and index.html; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    shown = panels(hist)
    if shown:
        fig, axes = plt.subplots(
            len(shown), 1, figsize=(9, 3.2 * len(shown)), sharex=True, squeeze=False
        )
        for ax, (ylabel, series) in zip(axes[:, 0], shown, strict=True):
            for label, pts in series.items():
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker=".", label=label)
            ax.set_ylabel(ylabel)
            if ylabel == "participation":
                ax.set_ylim(-0.05, 1.05)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
        axes[-1, 0].set_xlabel(hist.x_label)
        save(fig, "curves.png")

    curve = hist.model_curve()
    if curve:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
        xs = (("seconds", [c[1] for c in curve]), ("MB moved", [c[2] / 1e6 for c in curve]))
        for ax, (label, x) in zip(axes, xs, strict=True):
            ax.plot(x, [c[3] for c in curve], marker=".")
            ax.set_xlabel(label)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("nats/byte")
        fig.suptitle(hist.loss_label, fontsize=9)
        save(fig, "cost.png")

    if hist.refusals:
        reasons = sorted(hist.refusals.items(), key=lambda kv: -kv[1])
        fig, ax = plt.subplots(figsize=(7, 0.5 + 0.4 * len(reasons)))
        ax.barh([r for r, _ in reasons][::-1], [n for _, n in reasons][::-1])
        ax.set_xlabel("refused updates")
        save(fig, "refusals.png")

    page = out / "index.html"
    page.write_text(render_html(hist, [p.name for p in written]))
    written.append(page)
    return written


def summary_rows(hist: History) -> list[tuple[str, str]]:
    curve = hist.model_curve()
    rows = [
        (
            "source",
            f"{hist.source} ({hist.kind}{', regime ' + hist.regime if hist.regime else ''})",
        ),
        ("blocks", str(hist.blocks)),
    ]
    if hist.kind != "train":
        rounds = max((p.round + 1 for p in hist.points), default=0)
        rows += [
            ("rounds closed (most advanced block)", str(rounds)),
            ("accepted updates", str(hist.accepted)),
            ("refused updates", str(sum(hist.refusals.values()))),
            ("bytes moved", f"{hist.bytes_total / 1e6:.2f} MB"),
        ]
    if hist.points:
        mean_part = sum(p.participation for p in hist.points) / len(hist.points)
        rows.append(("mean participation", f"{mean_part:.1%}"))
    if curve:
        rows.append((f"first / last {hist.loss_label}", f"{curve[0][3]:.3f} / {curve[-1][3]:.3f}"))
    for label, pts in hist.evals.items():
        if pts:
            (x0, v0), (x1, v1) = pts[0], pts[-1]
            rows.append((label, f"{v0:.3f} at {x0} -> {v1:.3f} at {x1} ({hist.x_label})"))
    rows += hist.facts
    return rows


def render_html(hist: History, images: list[str]) -> str:
    table = "\n".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
        for k, v in summary_rows(hist)
    )
    figures = "\n".join(f'<figure><img src="{name}" alt="{name}"></figure>' for name in images)
    refusals = "".join(
        f"<li>{html.escape(reason)}: {n}</li>" for reason, n in hist.refusals.most_common()
    )
    axis = (
        "rounds closed, integers: round r as the status numbers it (from 0) sits at r + 1; the "
        "evaluation of the model after r rounds at r (0: the initial model)"
        if hist.x_label != "optimizer step"
        else "optimizer steps"
    )
    plotted = "".join(
        f"<li>{html.escape(y)}: <ul>"
        + "".join(f"<li>{html.escape(label)}</li>" for label in series)
        + "</ul></li>"
        for y, series in panels(hist)
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>blocktrain report</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}
th{{text-align:left;padding-right:1em}}img{{max-width:100%}}</style></head>
<body><h1>blocktrain report</h1>
<table>{table}</table>
<h2>What is plotted</h2>
<p>x axis: {html.escape(axis)}.</p>
<ul>{plotted}</ul>
{"<h2>Refusals</h2><ul>" + refusals + "</ul>" if refusals else ""}
{figures}
</body></html>
"""
