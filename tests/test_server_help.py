"""`bench serve --help`: every flag of the reference server has a meaning, its choices and its default,
in a named group; walks whatever flags the parser has (new EngineConfig fields included)."""

import argparse
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from reference_server.api.cli import FLAG_GROUPS, build_parser
from reference_server.config import EngineConfig


def _actions(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    return [(g.title or "", a) for g in parser._action_groups for a in g._group_actions
            if not isinstance(a, argparse._HelpAction)]  # fmt: skip


def test_every_flag_has_help_choices_and_default_in_a_group():
    parser = build_parser()
    actions = _actions(parser)
    flags = {a.dest for _, a in actions}
    assert {f.name for f in fields(EngineConfig)} - {"step_sleep_ms"} <= flags  # every config field is a flag
    for group, action in actions:
        name = action.option_strings[0]
        assert group in FLAG_GROUPS, f"{name} is outside the named groups (in {group!r})"
        text = action.help or ""
        assert len(text.split()) >= 3, f"{name} has no real help text: {text!r}"
        if action.default is not None:
            assert "default" in text, f"{name} does not show its default: {text!r}"
    for group in FLAG_GROUPS:
        assert any(g == group for g, _ in actions), f"group {group} is empty"


def test_help_lists_choices_and_defaults():
    parser = build_parser(prog="bench serve")
    text = parser.format_help()
    assert text.startswith("usage: bench serve")
    for expected in ("{continuous,dynamic,static}", "{fifo,sjf,priority}", "{off,ngram,draft,self}",
                     "{auto,native,triton,torch}", "(default: 16)", "--no-enable-prefix-caching"):  # fmt: skip
        assert expected in text, expected
    # group headers appear in the documented order
    positions = [text.index(f"\n{g}:") for g in FLAG_GROUPS]
    assert positions == sorted(positions)
    # a bad choice is a clear usage error, not a crash
    try:
        parser.parse_args(["--policy", "lifo"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("--policy lifo was accepted")


def test_bench_serve_help_runs():
    out = subprocess.run([str(Path(sys.executable).parent / "bench"), "serve", "--help"], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "usage: bench serve" in out.stdout and "speculation:" in out.stdout
