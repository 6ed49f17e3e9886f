"""One layer grammar (`exl3tool.selection`) for inspect, prepare and verify: what it accepts, resolves, refuses."""

from __future__ import annotations

import pytest

from exl3tool.errors import NotFoundError, UsageError
from exl3tool.selection import parse_layers
from helpers import EXAMPLE, run_cli

HAVE = [0, 1, 2, 3, 5, 6, 7]  # layer 4 absent, as in a checkpoint with a damaged layer


@pytest.mark.parametrize("text, want", [
    ("3", [3]), (5, [5]), ("0-2,7", [0, 1, 2, 7]), ("5-", [5, 6, 7]), (" 2 - 3 , 1 ", [1, 2, 3]), ("5,5", [5]),
    ("all", HAVE), ("ALL", HAVE), ("6-,0", [0, 6, 7]), ("3-", [3, 5, 6, 7]),  # an open range skips what is absent
])
def test_resolves_against_the_checkpoint_layers(text, want):
    assert parse_layers(text).resolve(HAVE) == want


@pytest.mark.parametrize("text", ["", "a", "3-1", "1,,2", "-2", "1-2-3", "-", "all,1", "1.5", "0x3"])
def test_malformed_selections_are_usage_errors(text):
    with pytest.raises(UsageError, match="--layer"):
        parse_layers(text)


@pytest.mark.parametrize("text, missing", [("4", 4), ("3-5", 4), ("0-999999999", 4), ("9", 9), ("8-", None)])
def test_absent_layers_are_named(text, missing):
    """A closed range must exist in full (checked without expanding it); an open one must reach some layer."""
    with pytest.raises(NotFoundError, match=f"no layer {missing}" if missing is not None else "no such layer"):
        parse_layers(text).resolve(HAVE, "ckpt")


def test_single():
    assert parse_layers("3").single and parse_layers(3).single
    assert not any(parse_layers(t).single for t in ("all", "3-4", "3-", "3,4"))


@pytest.mark.parametrize("option", ["--layer", "-l"])
def test_every_command_takes_the_same_grammar(tmp_path, option):
    """inspect lists the selected layers; prepare writes them; verify refuses the same typo the same way."""
    report = run_cli("inspect", EXAMPLE, option, "1-", "-f", "json").json()
    assert [d["index"] for d in report["layer_details"]] == [1] and report["layer_detail"]["index"] == 1
    both = run_cli("inspect", EXAMPLE, option, "all", "-f", "json").json()
    assert [d["index"] for d in both["layer_details"]] == [0, 1] and both["layer_detail"] is None
    prepared = run_cli("prepare", EXAMPLE, tmp_path / "out", option, "1-", "-f", "json", "-q").json()
    assert prepared["layers"] == [1] and prepared["includes_globals"] is False
    for command in (["inspect", EXAMPLE], ["prepare", EXAMPLE, tmp_path / "other"], ["verify", EXAMPLE]):
        result = run_cli(*command, option, "1-0")
        assert result.exit_code == 2 and result.stderr == \
            "exl3tool: usage error: --layer '1-0': the range 1-0 runs backwards\n"
