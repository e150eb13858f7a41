"""The command-line reference, rendered from the ``tatblimp`` argparse parsers: committed into the page, and
renewed at every site build (an MkDocs hook).

``docs/reference/cli.md`` holds the rendered reference between ``BEGIN`` and ``END``, so a reader of the repository
sees every option too. ``tests/test_docs_reference.py`` fails when the committed copy differs from what the parsers
give; after a parser changes, rewrite it with ``python docs/hooks/cli_reference.py`` (from the repository's root, in
the project's environment). At build time the hook replaces the copy with a fresh rendering, so the site cannot
drift even where the committed copy has.
"""

from __future__ import annotations

import argparse
import html
import os
import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])

PAGE = "reference/cli.md"
BEGIN = "<!-- cli-reference: generated from the parsers by `python docs/hooks/cli_reference.py`; do not edit -->"
END = "<!-- /cli-reference -->"
USAGE_WIDTH = "80"  # argparse wraps the usage line at $COLUMNS; 80 fits the page's code width


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    try:
        return with_reference(markdown, current_reference())
    except ValueError as err:
        from mkdocs.exceptions import PluginError

        raise PluginError(str(err)) from None


def current_reference() -> str:
    """``render_cli`` of this checkout's parsers."""
    # The package of this checkout, whatever else is installed (mkdocstrings reads its sources from "." too);
    # added here, since MkDocs restores sys.path after loading a hook.
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from tatblimp_callback.cli import build_parser

    return render_cli(build_parser())


def committed_reference(markdown: str) -> str:
    """The reference between the page's markers (ValueError when they are missing)."""
    if markdown.count(BEGIN) != 1 or markdown.count(END) != 1 or markdown.index(BEGIN) > markdown.index(END):
        raise ValueError(f"{PAGE} has lost its markers {BEGIN} ... {END}: the command-line reference has no place")
    return markdown[markdown.index(BEGIN) + len(BEGIN) : markdown.index(END)].strip("\n")


def with_reference(markdown: str, reference: str) -> str:
    """``markdown`` with ``reference`` between its markers."""
    committed_reference(markdown)  # the markers are there
    head, tail = markdown[: markdown.index(BEGIN) + len(BEGIN)], markdown[markdown.index(END) :]
    body = reference.strip("\n")
    return f"{head}\n\n{body}\n\n{tail}"


def render_cli(parser: argparse.ArgumentParser) -> str:
    """The Markdown of ``parser`` and, below it, of each of its subcommands (recursively)."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = USAGE_WIDTH
    try:
        return "\n".join(_render(parser, parser.prog, level=2, summary=parser.description))
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def _render(parser: argparse.ArgumentParser, name: str, level: int, summary: str | None) -> list[str]:
    anchor = name.replace(" ", "-")
    lines = [f"{'#' * level} `{name}` {{#{anchor}}}", ""]
    if summary:
        lines += [_escape_markdown(summary), ""]
    lines += ["```text", parser.format_usage().strip(), "```", ""]
    formatter = parser._get_formatter()
    subcommands: list[tuple[str, argparse.ArgumentParser, str | None]] = []
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {choice.dest: choice.help for choice in action._choices_actions}
                seen: set[int] = set()
                for sub_name, sub_parser in action.choices.items():
                    if id(sub_parser) not in seen:  # aliases share one parser
                        seen.add(id(sub_parser))
                        subcommands.append((sub_name, sub_parser, helps.get(sub_name)))
                rows.append(_row(", ".join(f"<code>{html.escape(n)}</code>" for n in helps), None, "the subcommand, below"))
            elif action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
                rows.append(_row(_names(action, formatter), _default(action), _help(action, formatter)))
        if rows:
            lines += [f"**{html.escape(group.title or 'options')}**", ""]
            lines += ["<table>", "<tr><th>argument</th><th>default</th><th>what it does</th></tr>", *rows, "</table>", ""]
    for sub_name, sub_parser, sub_help in subcommands:
        lines += _render(sub_parser, f"{name} {sub_name}", level + 1, sub_parser.description or sub_help)
    return lines


def _names(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    if not action.option_strings:
        metavar = formatter._metavar_formatter(action, action.dest)(1)[0]
        return f"<code>{html.escape(metavar, quote=False)}</code>"
    names = ", ".join(action.option_strings)
    if action.nargs != 0:
        names += " " + formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
    return f"<code>{html.escape(names, quote=False)}</code>"


def _default(action: argparse.Action) -> str | None:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
        return None
    return str(action.default)


def _help(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    text = formatter._expand_help(action) if action.help else ""
    return html.escape(text.strip(), quote=False)


def _row(names: str, default: str | None, help_html: str) -> str:
    default_html = f"<code>{html.escape(default, quote=False)}</code>" if default is not None else ""
    return f"<tr><td>{names}</td><td>{default_html}</td><td>{help_html}</td></tr>"


def _escape_markdown(text: str) -> str:
    for char in "\\`*_[]|":
        text = text.replace(char, "\\" + char)
    return html.escape(text, quote=False)


if __name__ == "__main__":  # rewrite the committed reference: python docs/hooks/cli_reference.py
    path = Path(REPO) / "docs" / PAGE
    text = path.read_text(encoding="utf-8")
    updated = with_reference(text, current_reference())
    path.write_text(updated, encoding="utf-8")
    print(f"{path}: {'rewritten' if updated != text else 'already up to date'}")
