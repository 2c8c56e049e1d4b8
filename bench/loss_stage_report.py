"""Reporting for bench/loss_stage.py: the CSV, the markdown table with its ratios, and the plot.

Nothing here measures. :func:`publish` writes the rows of a sweep (``<stem>.csv``) and reports them;
:func:`redraw` reports the rows of such a CSV again (``loss_stage.py --from-csv``). Reporting writes
``<stem>.png`` (log-log time and peak memory against B) and ``<stem>.md`` next to the CSV and prints
the table last. The table has one ratio column per baseline (its time over the row's: how many times
faster the row is) and one against the limit (the row's time over its limit's: how many times the
bare GEMM time the row takes; a row measured against another limit than the column's names it in the
cell), each at the same (B, D, k). Under the table, at each (B, D, k), come the legend's comparisons
(:func:`comparisons`): one provider's speed-ups over others that do its work, providers' times over
their own limits side by side, and the overhead of one provider over another that leaves part of its
work out.

A row is timed when it has a ``median_ms``; its ``note`` then records what the schema has no column
for (the Matryoshka dimensions). An untimed row's note says why it has no time.

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
    "Legend", "acceptance", "comparisons", "load_rows", "machine", "markdown_table", "plot", "publish", "ratio",
    "redraw", "report", "timed", "times_limit",
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
        separate: providers doing other work than the baselines (several Matryoshka dimensions): their
            "vs" cells stay blank.
        speedups: ``(provider, others)`` pairs: a line under the table with the provider's speed-up over
            each of ``others`` (which do the same work).
        overheads: ``(what, provider, without)`` triples: a line under the table with ``provider``'s time
            over ``without``'s, ``without`` being ``provider`` less ``what``.
        limits: ``(provider, its limit)`` pairs for the providers whose bare GEMMs are another provider than
            ``limit`` (a loss stage with other score blocks); a limit named here is its own limit.
        beside: ``(what, providers)`` pairs: a line under the table with each provider's time over its limit.
        headers: ``(providers, header, title)`` triples: the header and title of a report whose rows all come
            from ``providers`` (the first that holds them all), instead of ``header`` and ``title``.
    """

    order: tuple[str, ...]
    baselines: tuple[str, ...]
    limit: str
    featured: tuple[str, ...]
    header: str
    title: str
    separate: tuple[str, ...] = ()
    speedups: tuple[tuple[str, tuple[str, ...]], ...] = ()
    overheads: tuple[tuple[str, str, str], ...] = ()
    limits: tuple[tuple[str, str], ...] = ()
    beside: tuple[tuple[str, tuple[str, ...]], ...] = ()
    headers: tuple[tuple[tuple[str, ...], str, str], ...] = ()

    def limit_of(self, impl: str) -> str:
        """The provider whose time ``impl``'s is measured against: its own limit, or ``limit``."""
        own = dict(self.limits)
        return impl if impl in own.values() else own.get(impl, self.limit)

    def heading(self, impls: Sequence[str]) -> tuple[str, str]:
        """The header and title of a report of rows from ``impls``."""
        seen = set(impls)
        return next(((header, title) for providers, header, title in self.headers if seen and seen <= set(providers)),
                    (self.header, self.title))


def _times(value: float) -> str:
    """``value`` to 3 significant digits with a trailing ``x``, never in exponent form above 1."""
    return f"{float(f'{value:.3g}'):.15g}x"


def timed(row: _Row | None) -> bool:
    """Whether ``row`` is a measured row (it has a time), not a skip or a failure."""
    return row is not None and row.get("median_ms") not in (None, "")


def ratio(base: _Row | None, row: _Row) -> str:
    """Speed-up of ``row`` over ``base`` as text, blank when either is missing."""
    if not (timed(base) and timed(row)):
        return ""
    return _times(base["median_ms"] / row["median_ms"])


def versus(base: _Row, row: _Row) -> str:
    """``row`` against ``base`` as text: "N x faster than" or, below 1, "N x slower than" the base's provider."""
    speedup = base["median_ms"] / row["median_ms"]
    if speedup >= 1:
        return f"{_times(speedup)} faster than {base['impl']}"
    return f"{_times(1 / speedup)} slower than {base['impl']}"


def times_limit(limit: _Row | None, row: _Row) -> str:
    """``row``'s time as a multiple of ``limit``'s as text, blank when either is missing."""
    if not (timed(limit) and timed(row)):
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
        done = timed(r)
        limit = legend.limit_of(r["impl"])
        over_limit = times_limit(by_size.get((*at, limit)), r)
        cells = [
            *at, r["impl"],
            f"{r['median_ms']:.1f}" if done else "",
            f"{r['p20_ms']:.1f}-{r['p80_ms']:.1f}" if done else "",
            f"{r['peak_mb']:.1f}" if done else "",
            *("" if r["impl"] in legend.separate else ratio(by_size.get((*at, b)), r) for b in legend.baselines),
            f"{over_limit} {limit}" if over_limit and limit != legend.limit else over_limit,
            r["note"],
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def comparisons(rows: Sequence[_Row], legend: Legend) -> list[str]:
    """The legend's speed-up, beside-the-limit and overhead lines, at each (B, D, k) where their rows are timed.

    A speed-up line names the provider's note (its Matryoshka dimensions) when it has one; a beside line
    needs every provider it names and their limits.
    """
    by_size = {(r["B"], r["D"], r["k"], r["impl"]): r for r in rows if timed(r)}
    lines = []
    for at in sorted({(r["B"], r["D"], r["k"]) for r in rows}, key=lambda at: (at[1], at[2], at[0])):
        where = "B={}, D={}, k={}".format(*at)
        for impl, others in legend.speedups:
            r = by_size.get((*at, impl))
            faster = [versus(by_size[(*at, o)], r) for o in others if r is not None and (*at, o) in by_size]
            if faster:
                note = f" ({r['note']})" if r.get("note") else ""
                lines.append(f"{impl} at {where}{note}: {', '.join(faster)}")
        for what, impls in legend.beside:
            pairs = [(by_size.get((*at, impl)), legend.limit_of(impl)) for impl in impls]
            if all(r is not None and (*at, limit) in by_size for r, limit in pairs):
                cells = [f"{r['impl']} {times_limit(by_size[(*at, limit)], r)} {limit}" for r, limit in pairs]
                lines.append(f"{what} at {where}: {', '.join(cells)}")
        for what, impl, without in legend.overheads:
            r, base = by_size.get((*at, impl)), by_size.get((*at, without))
            if r is not None and base is not None:
                extra = 100 * (r["median_ms"] / base["median_ms"] - 1)
                lines.append(f"{what} overhead at {where}: {extra:+.1f}% "
                             f"({impl} {r['median_ms']:.1f} ms, {without} {base['median_ms']:.1f} ms)")
    return lines


def plot(rows: Sequence[_Row], path: Path, title: str, legend: Legend) -> Path:
    """Log-log time and peak memory against B, one line per provider (the limits dashed), a row of panels per (D, k)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["D"], r["k"]) for r in rows})
    limits = {legend.limit, *(limit for _, limit in legend.limits)}
    fig, axes = plt.subplots(len(shapes), 2, figsize=(11, 3.6 * len(shapes)), squeeze=False)
    for (dim, k), (ax_t, ax_m) in zip(shapes, axes):
        for impl in legend.order:
            done = sorted((r["B"], r["median_ms"], r["peak_mb"]) for r in rows
                          if (r["impl"], r["D"], r["k"]) == (impl, dim, k) and timed(r))
            if not done:
                continue
            bs, ms, mb = zip(*done)
            style = dict(marker="o", label=impl, linestyle="--" if impl in limits else "-")
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
    by_impl = {r["impl"]: r for r in rows if (r["B"], r["D"], r["k"]) == size and timed(r)}
    lines = []
    for impl in legend.featured:
        if impl not in by_impl or not all(b in by_impl for b in legend.baselines):
            continue
        r, last = by_impl[impl], legend.baselines[-1]
        faster = ", ".join(versus(by_impl[b], r) for b in legend.baselines)
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
    """Write ``<stem>.png`` and ``<stem>.md`` (header line, table, comparisons) under ``out``; print the latter last."""
    where = machine(device)
    header, title = legend.heading([r["impl"] for r in rows])
    png_path = plot(rows, out / f"{stem}.png", f"{title}, {device}: {where}", legend)
    under = "\n".join(comparisons(rows, legend))
    text = "\n\n".join(part for part in (f"{header} on {where}", markdown_table(rows, legend), under) if part)
    (out / f"{stem}.md").write_text(f"{text}\n")
    print(f"wrote {png_path}")
    for line in acceptance(rows, legend):
        print(line)
    print()
    print(text)


def publish(rows: Sequence[_Row], out: Path, stem: str, device: str, legend: Legend) -> None:
    """Write the rows to ``<stem>.csv`` under ``out`` (created if missing), then :func:`report` them."""
    out.mkdir(parents=True, exist_ok=True)
    print(f"wrote {common.write_csv(out / f'{stem}.csv', rows)}")
    report(rows, out, stem, device, legend)


def redraw(csv_path: Path, device: str, legend: Legend) -> None:
    """Report the rows of ``csv_path`` again, next to it (``device`` where the CSV has no rows)."""
    rows = load_rows(csv_path)
    report(rows, csv_path.parent, csv_path.stem, rows[0]["device"] if rows else device, legend)
