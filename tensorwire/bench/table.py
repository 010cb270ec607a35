"""The result table of ``tensorwire bench`` (nccl-tests style, with a units row) and its plot."""

from __future__ import annotations

import math
import textwrap

from tensorwire.bench.schema import Fit, Row
from tensorwire.units import nbytes_text

__all__ = ["format_table", "plot"]


_REASON_WIDTH = 44


def _shorten(text: str, width: int = _REASON_WIDTH) -> str:
    """``text`` cut at a word boundary to ``width`` characters, "…" marking the cut."""
    if len(text) <= width:
        return text
    short = textwrap.shorten(text, width=width, placeholder=" …")
    return short if short != "…" and short.strip() != "…" else text[: width - 1] + "…"


def _rate(gbps: float) -> str:
    """A bandwidth cell: "-" where the time was too short to measure (an infinite rate)."""
    return f"{gbps:.3f}" if math.isfinite(gbps) else "-"


def _fit_line(f: Fit) -> str:
    if math.isfinite(f.bandwidth_gbps):
        bandwidth = f"bandwidth {f.bandwidth_gbps:8.2f} GB/s"
    else:
        bandwidth = "bandwidth not measurable (the time did not grow with the size)"
    return f"  {f.scenario:14} {f.method:40} latency {f.latency_us:10.1f} us   {bandwidth}"


def format_table(rows: list[Row], fits: list[Fit]) -> str:
    """The result table (with a units row) and the latency/bandwidth fits, as text."""
    header = (
        "scenario",
        "method",
        "transport: reason",
        "size",
        "tensors",
        "peers",
        "p50",
        "p99",
        "algbw",
        "busbw",
        "#wrong",
        "vs best alt",
        "vs memcpy",
    )
    units = ("", "", "", "bytes", "", "", "us", "us", "GB/s", "GB/s", "", "x (>1 faster)", "x of bound")
    lines = [header, units]
    for r in rows:
        reason = f"{r.transport}: {r.reason}" if r.transport else r.reason
        lines.append(
            (
                r.scenario,
                r.method,
                _shorten(reason),
                nbytes_text(r.nbytes, compact=True),
                str(r.tensors),
                str(r.peers),
                f"{r.p50_us:.1f}",
                f"{r.p99_us:.1f}",
                _rate(r.gbps),
                _rate(r.busbw_gbps),
                "-" if r.wrong < 0 else str(r.wrong),
                "" if r.vs_best_baseline is None else f"{r.vs_best_baseline:.2f}",
                "" if r.vs_memcpy is None else f"{r.vs_memcpy:.2f}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [
        "  ".join(
            cell.rjust(w) if i >= 3 else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in lines
    ]
    if fits:
        text += ["", "fixed cost per transfer and asymptotic bandwidth (least-squares fit over sizes):"]
        text += [_fit_line(f) for f in fits]
    return "\n".join(text)


def plot(rows: list[Row], path: str) -> None:
    """GB/s against size per method, one panel per scenario with several sizes (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'tensorwire[plot]'") from None
    scenarios = [
        s for s in dict.fromkeys(r.scenario for r in rows) if len({r.nbytes for r in rows if r.scenario == s}) > 1
    ]
    if not scenarios:
        raise RuntimeError("--plot needs a scenario measured at two or more sizes")
    figure, axes = plt.subplots(len(scenarios), 1, figsize=(9, 4.5 * len(scenarios)), squeeze=False)
    for axis, scenario in zip(axes[:, 0], scenarios, strict=True):
        methods = dict.fromkeys(r.method for r in rows if r.scenario == scenario)
        for method in methods:
            points = sorted((r.nbytes, r.gbps) for r in rows if r.scenario == scenario and r.method == method)
            style = "--" if any(r.baseline for r in rows if r.method == method) else "-"
            axis.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=method)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("bytes per transfer")
        axis.set_ylabel("GB/s (algorithm bandwidth, median)")
        axis.set_title(scenario)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
