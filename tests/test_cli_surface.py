"""The `conveyor` command keeps every verb and flag it ever offered (tests/cli_surface.txt)."""

from __future__ import annotations

import argparse
from pathlib import Path

from worker.cli import build_parser

SURFACE = Path(__file__).with_name("cli_surface.txt")


def surface(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("conveyor",)) -> set[str]:
    """"conveyor VERB ..." for each verb and "conveyor VERB ... --flag" for each of its flags."""
    found = {" ".join(path)}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= surface(sub, (*path, name))
        else:
            found |= {" ".join((*path, option)) for option in action.option_strings}
    return found


def test_every_verb_and_flag_recorded_is_still_offered():
    recorded = {line for line in SURFACE.read_text().splitlines()
                if line and not line.startswith("#")}
    assert len(recorded) > 200  # the record was read
    assert recorded - surface(build_parser()) == set()
