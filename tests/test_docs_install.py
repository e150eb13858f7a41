"""The install line the README and getting started lead with works today: no PyPI line before a release."""

from __future__ import annotations

import re

import pytest

from conftest import REPO

INDEX_INSTALL = re.compile(r"^\s*pip install ['\"]?tatblimp-callback\b", re.MULTILINE)


def latest_release_heading() -> str:
    """The CHANGELOG's newest version heading, e.g. '0.1.0 (unreleased)'."""
    return re.search(r"^## (.+)$", (REPO / "CHANGELOG.md").read_text(encoding="utf-8"), re.MULTILINE).group(1)


def install_section(page: str) -> str:
    text = (REPO / page).read_text(encoding="utf-8")
    start = text.index("## Install\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def first_code_block(section: str) -> str:
    return re.search(r"```(?:bash|sh|console)?\n(.*?)```", section, re.DOTALL).group(1)


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_first_install_command_is_one_that_works_before_the_release(page):
    released = "unreleased" not in latest_release_heading().lower()
    section = install_section(page)
    commands = first_code_block(section)
    if released:
        assert INDEX_INSTALL.search(commands), f"{page}: released, so lead with pip install tatblimp-callback"
        return
    # Unreleased: the index has no such package, so the page leads with the clone or the wheel, and says so.
    assert not INDEX_INSTALL.search(commands), f"{page} leads with a PyPI install, but {latest_release_heading()}"
    assert re.search(r"^\s*pip install (\.|dist/tatblimp_callback-[\d.]+-py3-none-any\.whl)", commands, re.MULTILINE)
    assert "not on PyPI yet" in section
    # A PyPI line may be named in the prose, as the way after the release, but no code block gives it as a command.
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", section, re.DOTALL):
        assert not INDEX_INSTALL.search(block), f"{page}: a PyPI install command before the release"


def test_the_wheel_named_on_the_pages_is_this_version():
    from tatblimp_callback import __version__

    for page in ("README.md", "docs/getting-started.md"):
        names = set(re.findall(r"tatblimp_callback-([\d.]+)-py3-none-any\.whl", install_section(page)))
        assert names == {__version__}, page
