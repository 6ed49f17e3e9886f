"""`--plot FILE.png`: median time against tokens, one panel per case group, one line per implementation and
mode (graph solid, eager dashed), the bytes floor dotted. matplotlib is the optional ``plot`` extra."""

from __future__ import annotations

import math

from exl3tool.bench.report import BenchReport
from exl3tool.bench.request import require_matplotlib
from exl3tool.errors import OutputError

STYLE = {"graph": "-", "eager": "--"}


def write_plot(report: BenchReport, path: str) -> None:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    groups = report.groups()
    cols = min(3, max(1, len(groups)))
    rows = math.ceil(len(groups) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows), squeeze=False)
    env = report.environment
    fig.suptitle(f"{env.gpu} ({env.copy_tbs:.2f} TB/s copy), {env.commit or 'no commit'}, {env.date}",
                 fontsize=9)
    for ax, (group, cases) in zip(axes.flat, groups.items()):
        lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for c in cases:
            for r in c.results:
                if r.timing is not None:
                    lines.setdefault((r.implementation, r.mode), []).append((c.tokens, r.timing.median_us))
        for (impl, mode), points in lines.items():
            points.sort()
            ax.plot(*zip(*points), STYLE.get(mode, "-"), marker="o", markersize=3, label=f"{impl} ({mode})")
        floor = sorted((c.tokens, c.floor_us) for c in cases)
        ax.plot(*zip(*floor), ":", color="gray", label="bytes floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens (M)")
        ax.set_ylabel("median us per call")
        ax.set_title(group, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as err:
        raise OutputError(f"cannot write the plot: {err.strerror or err}", path=path) from None
    finally:
        plt.close(fig)
