"""The generated command-line reference (docs/hooks/cli_reference.py) shows every subcommand and option."""

from __future__ import annotations

import argparse
import html
import re

from conftest import REPO, load_module
from tatblimp_callback.cli import build_parser


def load_hook():
    return load_module(REPO / "docs" / "hooks" / "cli_reference.py")


def commands(parser: argparse.ArgumentParser, name: str = "tatblimp"):
    """(full command name, parser) of the parser and every subcommand below it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub_parser in action.choices.items():
                yield from commands(sub_parser, f"{name} {sub_name}")


def test_every_subcommand_and_option_is_in_its_section():
    markdown = load_hook().render_cli(build_parser())
    headings = [(m.start(), m.group(1)) for m in re.finditer(r"^#+ `([^`]+)`", markdown, re.MULTILINE)]
    sections = {
        name: markdown[start : (headings[i + 1][0] if i + 1 < len(headings) else len(markdown))]
        for i, (start, name) in enumerate(headings)
    }
    found = list(commands(build_parser()))
    assert [name for name, _ in found] == [name for _, name in headings]
    assert {"tatblimp score", "tatblimp sweep", "tatblimp compare"} <= set(sections)
    for name, parser in found:
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
                continue  # subcommands are checked as headings above
            for option in action.option_strings or [action.metavar or action.dest]:
                assert re.search(rf"<code>[^<]*{re.escape(option)}\b", sections[name]), f"{name}: {option} missing"
            if action.help:  # as --help prints it (%(default)s and %% expanded)
                expanded = parser._get_formatter()._expand_help(action)
                assert html.escape(expanded, quote=False) in sections[name], f"{name}: the help of {option}"


def test_the_committed_reference_is_what_the_parsers_give():
    """docs/reference/cli.md holds the reference for readers of the repository: the parsers' own, to the character.
    After a parser changes: python docs/hooks/cli_reference.py (rewrites it)."""
    hook = load_hook()
    page = (REPO / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    committed = hook.committed_reference(page)
    assert committed == hook.render_cli(build_parser()).strip("\n"), "run: python docs/hooks/cli_reference.py"
    assert committed.count("<tr><td><code>") > 150
    for name, _ in commands(build_parser()):
        assert f"`{name}` {{#{name.replace(' ', '-')}}}" in committed
    # The site build puts a fresh copy in the same place: the page as the hook gives it has the reference once.
    assert hook.with_reference(page, hook.current_reference()) == page


def test_the_long_run_guide_names_every_option_of_the_callback():
    import dataclasses

    from tatblimp_callback import TatBLiMPCallback

    page = (REPO / "docs" / "guides" / "long-runs.md").read_text(encoding="utf-8")
    options = page[page.index("## Options") : page.index("## What the callback guarantees")]
    fields = [field.name for field in dataclasses.fields(TatBLiMPCallback) if field.init]
    assert len(fields) >= 20
    assert [name for name in fields if f"`{name}`" not in options] == []
