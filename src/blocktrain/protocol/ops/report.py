"""`blocktrain report`: a run's history (`protocol.store.history`) drawn as PNG plots and one HTML
page that shows them with a summary.

    loss.png           the model's loss against rounds, time and bytes moved
    participation.png  participation of each round, per block
    refusals.png       refused updates by reason
    block_loss.png     each block's loss by round (state folders: the workers' reported loss)
    index.html         the summary table and the plots (no script, no external resource)
"""

from __future__ import annotations

import html
from pathlib import Path

from blocktrain.protocol.store.history import History

PLOTS = ("loss.png", "participation.png", "refusals.png", "block_loss.png")


def write_report(hist: History, out: Path) -> list[Path]:
    """Every plot that has data, and index.html; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: object, name: str) -> None:
        path = out / name
        fig.tight_layout()  # type: ignore[attr-defined]
        fig.savefig(path, dpi=100)  # type: ignore[attr-defined]
        plt.close(fig)  # type: ignore[arg-type]
        written.append(path)

    curve = hist.model_curve()
    if curve:
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
        xs = (
            ("rounds closed (slowest block)", [c[0] for c in curve]),
            ("seconds", [c[1] for c in curve]),
            ("MB moved", [c[2] / 1e6 for c in curve]),
        )
        for ax, (label, x) in zip(axes, xs, strict=True):
            ax.plot(x, [c[3] for c in curve], marker=".")
            ax.set_xlabel(label)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel(hist.loss_label)
        save(fig, "loss.png")

    per_block = hist.per_block()
    if per_block:
        fig, ax = plt.subplots(figsize=(7, 3.8))
        for b, pts in sorted(per_block.items()):
            ax.plot(
                [p.round for p in pts],
                [p.participation for p in pts],
                marker=".",
                label=f"block {b}",
            )
        ax.set_xlabel("round")
        ax.set_ylabel("participation")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "participation.png")

    if hist.refusals:
        reasons = sorted(hist.refusals.items(), key=lambda kv: -kv[1])
        fig, ax = plt.subplots(figsize=(7, 0.5 + 0.4 * len(reasons)))
        ax.barh([r for r, _ in reasons][::-1], [n for _, n in reasons][::-1])
        ax.set_xlabel("refused updates")
        save(fig, "refusals.png")

    with_loss = {
        b: [(p.round, p.loss) for p in pts if p.loss is not None]
        for b, pts in sorted(per_block.items())
    }
    if any(with_loss.values()):
        fig, ax = plt.subplots(figsize=(7, 3.8))
        for b, series in with_loss.items():
            if series:
                ax.plot(*zip(*series, strict=True), marker=".", label=f"block {b}")
        ax.set_xlabel("round")
        ax.set_ylabel(hist.loss_label)
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "block_loss.png")

    page = out / "index.html"
    page.write_text(render_html(hist, [p.name for p in written]))
    written.append(page)
    return written


def summary_rows(hist: History) -> list[tuple[str, str]]:
    curve = hist.model_curve()
    rounds = max((p.round + 1 for p in hist.points), default=0)
    rows = [
        (
            "source",
            f"{hist.source} ({hist.kind}{', regime ' + hist.regime if hist.regime else ''})",
        ),
        ("blocks", str(hist.blocks)),
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
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>blocktrain report</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}
th{{text-align:left;padding-right:1em}}img{{max-width:100%}}</style></head>
<body><h1>blocktrain report</h1>
<table>{table}</table>
{"<h2>Refusals</h2><ul>" + refusals + "</ul>" if refusals else ""}
{figures}
</body></html>
"""
