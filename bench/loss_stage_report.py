"""Reporting for bench/loss_stage.py: the CSV, the markdown table with its ratios, and the plot.

Nothing here measures. :func:`publish` writes the rows of a sweep (``<stem>.csv``) and reports them;
:func:`redraw` reports the rows of such a CSV again (``loss_stage.py --from-csv``). Reporting writes
``<stem>.png`` (log-log time and peak memory against B) and ``<stem>.md`` next to the CSV and prints
the table last. The table has one ratio column per baseline (its time over the row's: how many times
faster the row is) and one against the limit (the row's time over the limit's: how many times the
bare GEMM time the row takes), each at the same (B, D, k).

What the report knows of the providers (their order, which are baselines, which is the limit, the
header words) comes in a :class:`Legend` from the measuring script.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import common

__all__ = [
    "Legend", "acceptance", "load_rows", "machine", "markdown_table", "plot", "publish", "ratio", "redraw",
    "report", "times_limit",
]

_Row = Mapping[str, object]


@dataclass(frozen=True)
class Legend:
    """The providers as the report shows them.

    Args:
        order: every provider, in table and plot order.
        baselines: providers with a "vs <name>" speed-up column.
        limit: the provider of the "x <name>" column (the bare GEMMs).
        featured: providers with a summary line (:func:`acceptance`) when all baselines ran.
        header: what was measured, the start of the table's header line (the machine follows).
        title: the start of the plot's title (device and machine follow).
    """

    order: tuple[str, ...]
    baselines: tuple[str, ...]
    limit: str
    featured: tuple[str, ...]
    header: str
    title: str


def _times(value: float) -> str:
    """``value`` to 3 significant digits with a trailing ``x``, never in exponent form above 1."""
    return f"{float(f'{value:.3g}'):.15g}x"


def _timed(row: _Row | None) -> bool:
    return row is not None and not row.get("note")


def ratio(base: _Row | None, row: _Row) -> str:
    """Speed-up of ``row`` over ``base`` as text, blank when either is missing."""
    if not (_timed(base) and _timed(row)):
        return ""
    return _times(base["median_ms"] / row["median_ms"])


def times_limit(limit: _Row | None, row: _Row) -> str:
    """``row``'s time as a multiple of ``limit``'s as text, blank when either is missing."""
    if not (_timed(limit) and _timed(row)):
        return ""
    return _times(row["median_ms"] / limit["median_ms"])


def markdown_table(rows: Sequence[_Row], legend: Legend) -> str:
    """Markdown table of all rows, with the baseline and limit ratios at the same size."""
    by_size = {(r["B"], r["D"], r["k"], r["impl"]): r for r in rows}
    names = [f"vs {b}" for b in legend.baselines] + [f"x {legend.limit}"]
    lines = [
        "| B | D | k | impl | median ms | p20-p80 ms | peak MB | " + " | ".join(names) + " | note |",
        "|---:|---:|---:|---|---:|---:|---:|" + "---:|" * len(names) + "---|",
    ]
    for r in sorted(rows, key=lambda r: (r["D"], r["k"], r["B"], legend.order.index(r["impl"]))):
        at = (r["B"], r["D"], r["k"])
        timed = not r["note"]
        cells = [
            *at, r["impl"],
            f"{r['median_ms']:.1f}" if timed else "",
            f"{r['p20_ms']:.1f}-{r['p80_ms']:.1f}" if timed else "",
            f"{r['peak_mb']:.1f}" if timed else "",
            *(ratio(by_size.get((*at, b)), r) for b in legend.baselines),
            times_limit(by_size.get((*at, legend.limit)), r),
            r["note"],
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def plot(rows: Sequence[_Row], path: Path, title: str, legend: Legend) -> Path:
    """Log-log time and peak memory against B, one line per provider (the limit dashed), a row of panels per (D, k)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["D"], r["k"]) for r in rows})
    fig, axes = plt.subplots(len(shapes), 2, figsize=(11, 3.6 * len(shapes)), squeeze=False)
    for (dim, k), (ax_t, ax_m) in zip(shapes, axes):
        for impl in legend.order:
            done = sorted((r["B"], r["median_ms"], r["peak_mb"]) for r in rows
                          if (r["impl"], r["D"], r["k"]) == (impl, dim, k) and not r["note"])
            if not done:
                continue
            bs, ms, mb = zip(*done)
            style = dict(marker="o", label=impl, linestyle="--" if impl == legend.limit else "-")
            ax_t.plot(bs, ms, **style)
            ax_m.plot(bs, [max(m, 1e-2) for m in mb], **style)
        for ax, ylabel in ((ax_t, "median time per call (ms)"), (ax_m, "peak memory above inputs (MB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch size B (= N)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"D={dim}, k={k}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def acceptance(rows: Sequence[_Row], legend: Legend, size: tuple[int, int, int] = (1024, 384, 1)) -> list[str]:
    """One line per featured provider at ``size`` (B, D, k): speed-ups and peak memory against the baselines."""
    by_impl = {r["impl"]: r for r in rows if (r["B"], r["D"], r["k"]) == size and not r["note"]}
    lines = []
    for impl in legend.featured:
        if impl not in by_impl or not all(b in by_impl for b in legend.baselines):
            continue
        r, last = by_impl[impl], legend.baselines[-1]
        faster = ", ".join(f"{ratio(by_impl[b], r)} faster than {b}" for b in legend.baselines)
        lines.append(
            f"{impl} at B={size[0]}, D={size[1]}, k={size[2]}: {faster}; "
            f"peak {r['peak_mb']:.1f} MB vs {by_impl[last]['peak_mb']:.1f} MB ({last})"
        )
    return lines


def machine(device: str) -> str:
    """One line naming the hardware and software the numbers come from."""
    import torch

    if device == "cuda":
        hw = torch.cuda.get_device_name()
    else:
        hw = platform.processor() or platform.machine()
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
            hw = next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name")), hw)
        except OSError:
            pass
        hw = f"{hw}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return f"{hw}; torch {torch.__version__}, Python {platform.python_version()}"


def load_rows(path: Path) -> list[dict[str, object]]:
    """Rows of a CSV written by :func:`publish`, with numbers parsed back."""
    rows = common.read_csv(path)
    for r in rows:
        r.update({c: int(r[c]) for c in ("B", "N", "D", "Dg", "k")})
        r.update({c: float(r[c]) if r[c] else "" for c in ("median_ms", "p20_ms", "p80_ms", "peak_mb")})
    return rows


def report(rows: Sequence[_Row], out: Path, stem: str, device: str, legend: Legend) -> None:
    """Write ``<stem>.png`` and ``<stem>.md`` under ``out`` and print the table last."""
    where = machine(device)
    png_path = plot(rows, out / f"{stem}.png", f"{legend.title}, {device}: {where}", legend)
    table = markdown_table(rows, legend)
    header = f"{legend.header} on {where}"
    (out / f"{stem}.md").write_text(f"{header}\n\n{table}\n")
    print(f"wrote {png_path}")
    for line in acceptance(rows, legend):
        print(line)
    print()
    print(header)
    print()
    print(table)


def publish(rows: Sequence[_Row], out: Path, stem: str, device: str, legend: Legend) -> None:
    """Write the rows to ``<stem>.csv`` under ``out`` (created if missing), then :func:`report` them."""
    out.mkdir(parents=True, exist_ok=True)
    print(f"wrote {common.write_csv(out / f'{stem}.csv', rows)}")
    report(rows, out, stem, device, legend)


def redraw(csv_path: Path, device: str, legend: Legend) -> None:
    """Report the rows of ``csv_path`` again, next to it (``device`` where the CSV has no rows)."""
    rows = load_rows(csv_path)
    report(rows, csv_path.parent, csv_path.stem, rows[0]["device"] if rows else device, legend)
