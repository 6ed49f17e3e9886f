"""Render an InspectReport: Rich (summary, bitrate histogram, per-layer table, layer detail, problems) or JSON."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from exl3tool.cli.render.common import bits, emit_json, problems, safe, size
from exl3tool.inspection import InspectReport, LayerDetail, LayerRow

_BAR = 30


def render_json(report: InspectReport) -> None:
    emit_json(report.to_json())


def _summary(report: InspectReport) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    arch = f"{report.architecture or '?'} ({report.model_type or '?'})"
    table.add_row("architecture", safe(arch))
    table.add_row("converter", safe(f"ExLlamaV3 {report.converter_version or '?'}"))
    layers = f"{report.num_layers}"
    if report.moe_layers:
        layers += (f" ({report.moe_layers} MoE, {report.experts_per_layer} experts, top-{report.top_k}, "
                   f"{report.routing})")
    table.add_row("layers", safe(layers))
    if report.activation is not None:
        table.add_row("MLP activation", safe(report.activation))
    codebooks = ", ".join(f"{name} {count}" for name, count in report.codebooks.items()) or "-"
    table.add_row("EXL3 linears", safe(f"{report.exl3_linears} ({codebooks})"))
    table.add_row("bits per weight", safe(
        f"K {bits(report.mean_bits)} mean, {bits(report.effective_bits)} effective incl. suh/svh "
        f"(config says {bits(report.config_bits)}), lm_head excluded"))
    head = report.head
    if head.kind == "exl3":
        head_text = f"EXL3 K={bits(head.bits)} {head.codebook}, {bits(head.effective_bits)} effective"
    elif head.kind == "unquantized":
        head_text = f"unquantized {head.dtype}"
    else:
        head_text = "none"
    table.add_row("lm_head", safe(head_text))
    table.add_row("size", safe(f"{size(report.file_bytes)} in {report.files} file(s), {report.tensors} tensors; "
                               f"EXL3 linears {size(report.exl3_bytes)}"))
    return table


def _histogram(report: InspectReport) -> Table:
    table = Table(title="bitrate histogram (share of weights, lm_head excluded)", title_justify="left",
                  show_header=False, box=None, padding=(0, 1))
    for b in report.histogram:
        bar = "█" * max(1, round(b.share * _BAR)) if b.share > 0 else ""
        table.add_row(f"K={bits(b.bits)}", Text(bar.ljust(_BAR), style="cyan"), f"{b.share * 100:5.1f}%",
                      f"{b.linears} linears")
    return table


def _layer_cells(row: LayerRow) -> list:
    mlp = {"moe": f"MoE {row.experts} experts" + (" + shared" if row.shared_experts else ""),
           "dense": "dense"}.get(row.mlp or "", "-")
    attention = ",".join(name.removeprefix("in_proj_").removesuffix("_proj") for name in row.attention)
    if row.attention_kind in ("linear", "conv"):
        attention = f"{row.attention_kind} {attention}"
    return [str(row.index), safe(attention or "-"), safe(mlp), str(row.linears),
            ", ".join(bits(b) for b in row.bits), safe(", ".join(row.codebooks)), bits(row.effective_bits),
            size(row.bytes)]


def _layers(report: InspectReport) -> Table:
    table = Table(title="layers", title_justify="left")
    for name, justify in (("layer", "right"), ("attention", "left"), ("mlp", "left"), ("linears", "right"),
                          ("K", "left"), ("codebook", "left"), ("bpw", "right"), ("size", "right")):
        table.add_column(name, justify=justify)
    for row in report.layers:
        table.add_row(*_layer_cells(row))
    return table


def _detail(report: InspectReport, detail: LayerDetail) -> Table:
    rows = detail.linears
    prefix = _common_prefix([r.name for r in rows])
    names = [r.name[len(prefix):] for r in rows]
    table = Table(title=f"layer {detail.index}: {prefix}*", title_justify="left")
    table.add_column("linear", no_wrap=True, min_width=max(map(len, names), default=6))
    for name in ("role", "in x out", "K", "codebook", "bpw"):
        table.add_column(name)
    several_files = report.files > 1
    if several_files:
        table.add_column("file", overflow="fold")
    for r, name in zip(rows, names):
        extras = " +bias" if r.bias else ""
        extras += " legacy su/sv" if r.legacy_signs else ""
        dims = f"{r.in_features}x{r.out_features}"
        if (r.in_padded, r.out_padded) != (r.in_features, r.out_features):
            dims += f" (pad {r.in_padded}x{r.out_padded})"
        cells = [safe(name), r.role, dims, bits(r.bits), safe(r.codebook + extras), bits(r.effective_bits)]
        table.add_row(*cells, *([safe(r.file)] if several_files else []))
    return table


def _common_prefix(names: list[str]) -> str:
    """The shared dotted prefix, e.g. 'model.layers.3.'."""
    if not names:
        return ""
    parts = [n.split(".") for n in names]
    common = []
    for group in zip(*(p[:-1] for p in parts)):
        if len(set(group)) != 1:
            break
        common.append(group[0])
    return ".".join(common) + "." if common else ""


def render_human(report: InspectReport, console: Console) -> None:
    what = "prepared folder (exl3tool prepare) " if report.prepared else "EXL3 checkpoint "
    console.print(Text.assemble((what, "bold"), safe(report.source, "bold cyan")))
    console.print(_summary(report))
    if report.histogram:
        console.print(_histogram(report))
    if report.layers:
        console.print(_layers(report))
    for detail in report.details:
        console.print(_detail(report, detail))
    for note in report.notes:
        console.print(safe(f"note: {note}", "yellow"), soft_wrap=True)
    problems(console, report.problems)
    if report.sound:
        console.print(Text("sound: no problems found", style="bold green"))
