"""`exl3tool bench`: time our kernels against peers on this GPU (or, with --sass, read their machine code for any
arch on the CPU). Every argument is checked before torch is imported."""

from __future__ import annotations

import re
import sys
from typing import Annotated, List, Optional

import typer

from exl3tool.cli.console import stderr, stdout
from exl3tool.cli.errors import EXIT_PROBLEMS, EXIT_SOUND, command_errors
from exl3tool.cli.params import FormatOpt, RevisionOpt, choice, wants_json
from exl3tool.errors import UsageError

DEFAULT_SHAPE = "4096x14336"


def bench(
    model: Annotated[Optional[str], typer.Argument(
        metavar="MODEL", help="EXL3 checkpoint (folder or hub id): with --layer N, its distinct linears and its "
        "MLP/MoE block, with their real weights.", show_default=False)] = None,
    layer: Annotated[Optional[int], typer.Option("--layer", "-l", metavar="N", min=0,
                                                 help="The decoder layer of MODEL.", show_default=False)] = None,
    shape: Annotated[Optional[List[str]], typer.Option(
        "--shape", metavar="INxOUT", help=f"A synthetic linear (repeatable; default {DEFAULT_SHAPE} when nothing "
        "else is asked for).", show_default=False)] = None,
    moe: Annotated[Optional[List[str]], typer.Option(
        "--moe", metavar="E:TOPK:H:I", help="A synthetic MoE block: experts, top-k, hidden, intermediate "
        "(repeatable).", show_default=False)] = None,
    bits: Annotated[str, typer.Option("--bits", "-k", metavar="K,...", help="Bitrates of the synthetic weights.")]
    = "4",
    codebook: Annotated[str, typer.Option("--codebook", metavar="3inst|mcg|mul1",
                                          help="Codebook of the synthetic weights.")] = "mcg",
    tokens: Annotated[str, typer.Option("--tokens", "-m", metavar="M,...", help="Token counts (rows of x).")]
    = "1,16,256,4096",
    mode: Annotated[str, typer.Option("--mode", metavar="graph|eager|both",
                                      help="CUDA-graph replays, eager launches (launch overhead), or both.")]
    = "graph",
    peer: Annotated[Optional[List[str]], typer.Option(
        "--peer", metavar="exllamav3", help="Also time this peer (repeatable): exllamav3.", show_default=False)]
    = None,
    plot: Annotated[Optional[str], typer.Option("--plot", metavar="FILE.png", show_default=False,
                                                help="Write time against tokens (needs the plot extra).")] = None,
    json_out: Annotated[Optional[str], typer.Option(
        "--json-out", metavar="FILE", show_default=False,
        help="Also write the JSON report to FILE (gzipped if it ends in .gz), with the human table on stdout.")] = None,
    from_json: Annotated[Optional[str], typer.Option(
        "--from-json", metavar="FILE", show_default=False,
        help="No GPU: render (and --plot) a report saved with --json-out (.json or .json.gz) or -f json.")] = None,
    sass: Annotated[bool, typer.Option("--sass", help="No GPU: compile the kernels for --arch (with --moe: the "
                                                     "fused MoE block's) and report registers, spills, shared "
                                                     "memory, CTAs an SM, SASS per weight.")] = False,
    arch: Annotated[str, typer.Option("--arch", metavar="sm_XX", help="Target of --sass.")] = "sm_120a",
    replays: Annotated[int, typer.Option("--replays", metavar="N", min=5, help="Timed repetitions per case.")]
    = 30,
    seed: Annotated[int, typer.Option("--seed", metavar="S", help="Seed of the random weights and inputs.")] = 0,
    dtype: Annotated[str, typer.Option("--dtype", metavar="float16|bfloat16", help="Activation dtype.")]
    = "float16",
    device: Annotated[str, typer.Option("--device", metavar="DEVICE", help="CUDA device, e.g. cuda:1.")]
    = "cuda",
    revision: RevisionOpt = None,
    output_format: FormatOpt = "human",
) -> None:
    """Time our kernels, checked against the fp32 reference first, with torch fp16, dequantize + fp16 and
    (--peer) ExLlamaV3 on the same shapes in the same run.

    Exit code 0: every implementation checked and timed; 1: one gave a wrong output or failed; 2: unusable
    input, no usable GPU, a peer or matplotlib that is not installed.
    """
    from exl3tool.bench import request as R

    as_json = wants_json(output_format)
    with command_errors(as_json):
        bits_list, token_list = R.parse_bits(bits), R.parse_tokens(tokens)
        codebook = codebook.strip().lower()
        if from_json is not None:
            _only("--from-json", (("MODEL", model), ("--layer", layer), ("--shape", shape), ("--moe", moe),
                                  ("--peer", peer), ("--sass", sass), ("--json-out", json_out)), mode)
            if plot is not None:
                R.require_matplotlib()
            report = _read_json(from_json)
        elif sass:
            _only("--sass", (("MODEL", model), ("--layer", layer), ("--shape", shape), ("--peer", peer),
                             ("--plot", plot), ("--json-out", json_out)), mode)
            from exl3tool.ops.targets import LIMITS, limits

            if not re.fullmatch(r"sm_\d{2,3}[af]?", arch):
                raise UsageError(f"--arch must look like sm_120a or sm_90a, not {arch!r}")
            try:
                limits(arch)
            except ValueError:
                raise UsageError(f"--arch {arch}: no SM limits known for it; known: {', '.join(LIMITS)}") from None
            for k in bits_list:
                R.check_bits(k, codebook)
            specs = [R.parse_moe(m) for m in moe or ()]
            from exl3tool.bench import moe_sass_report, sass_report

            with _progress("compiling") as progress:
                if specs:
                    report = moe_sass_report(arch, specs, bits_list, codebook, token_list, progress)
                else:
                    report = sass_report(arch, bits_list, codebook, token_list, progress)
            _render_sass(report, as_json)
            raise typer.Exit(EXIT_SOUND)
        else:
            shapes = [R.parse_shape(s) for s in shape or ()]
            if not (shapes or moe or model):
                shapes = [R.parse_shape(DEFAULT_SHAPE)]
            request = R.BenchRequest(
                shapes=tuple(shapes), moe=tuple(R.parse_moe(m) for m in moe or ()), model=model, layer=layer,
                revision=revision, bits=bits_list, codebook=codebook, tokens=token_list,
                modes=R.parse_modes(mode), peers=tuple(dict.fromkeys(p.strip().lower() for p in peer or ())),
                device=device, dtype=choice("--dtype", dtype, R.DTYPES), seed=seed, replays=replays)
            if plot is not None:
                R.require_matplotlib()
            from exl3tool.bench import run_bench

            with _progress("benchmarking") as progress:
                report = run_bench(request, progress, command=" ".join(["exl3tool", *sys.argv[1:]]))
        if as_json:
            from exl3tool.cli.render.bench import render_json

            render_json(report)
        else:
            from exl3tool.cli.render.bench import render_human

            render_human(report, stdout)
        if json_out is not None:
            _write_json(report, json_out)
        if plot is not None:
            from exl3tool.bench import write_plot

            write_plot(report, plot)
    raise typer.Exit(EXIT_PROBLEMS if report.wrong else EXIT_SOUND)


def _open_text(path: str, mode: str):
    """A report file: gzip-compressed when its name ends in ``.gz`` (the raw reports kept in docs/perf-raw)."""
    import gzip

    return gzip.open(path, mode + "t", encoding="utf-8") if str(path).endswith(".gz") else open(path, mode)


def _write_json(report, path: str) -> None:
    import json

    from exl3tool.errors import OutputError

    try:
        with _open_text(path, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    except OSError as err:
        raise OutputError(f"cannot write the JSON report: {err.strerror or err}", path=path) from None


def _read_json(path: str):
    import json

    from exl3tool.bench import BenchReport
    from exl3tool.errors import UnreadableInputError

    try:
        with _open_text(path, "r") as f:
            return BenchReport.from_json(json.load(f))
    except (OSError, EOFError) as err:  # gzip: a bad or truncated file
        raise UnreadableInputError(f"cannot read the report: {getattr(err, 'strerror', None) or err}",
                                   path=path) from None
    except (ValueError, KeyError, TypeError) as err:
        raise UnreadableInputError(f"not an exl3tool bench JSON report ({type(err).__name__}: {err})",
                                   path=path) from None


def _only(flag: str, others, mode: str) -> None:
    """``flag`` runs nothing on a GPU: the options that would are refused, naming them."""
    given = [name for name, value in others if value] + (["--mode"] if mode != "graph" else [])
    if given:
        raise UsageError(f"{flag} runs nothing on a GPU: drop {', '.join(given)}")


def _render_sass(report, as_json: bool) -> None:
    from exl3tool.cli.render.bench import render_sass_human, render_sass_json

    if as_json:
        render_sass_json(report)
    else:
        render_sass_human(report, stdout)


class _progress:
    """A transient Rich progress bar on stderr, on a terminal only; the library calls (done, total, label)."""

    def __init__(self, verb: str):
        self.verb, self._bar = verb, None

    def __enter__(self):
        if not stderr.is_terminal:
            return None
        from rich.markup import escape
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from exl3tool.errors import terminal_safe

        self._bar = Progress(TextColumn(f"{self.verb} {{task.description}}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), console=stderr, transient=True)
        self._bar.start()
        task = self._bar.add_task("", total=None)
        return lambda done, total, label: self._bar.update(task, completed=done, total=total,
                                                           description=escape(terminal_safe(label)))

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.stop()
