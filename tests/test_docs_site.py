"""The documentation site works opened from disk, as the README says to open it (``site/index.html``): built
strictly, every internal link of every page names a file that exists (no folder URLs, which ``file://`` shows as a
directory listing), and in headless Chromium a navigation link opens its page. Getting started fits a 1280-pixel
window: its tables and shell blocks (not the Python snippets, which run as written) need no horizontal scrolling."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from conftest import REPO

CHROMIUM = os.environ.get("TATBLIMP_CHROMIUM", "/usr/bin/chromium")
LINK = re.compile(r'(?:href|src)="([^"]*)"')

pytestmark = pytest.mark.slow  # builds the whole site (mkdocstrings reads the package), then starts a browser


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    folder = tmp_path_factory.mktemp("site")
    completed = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return folder


def internal_links(page: Path) -> list[str]:
    """The page's links that stay on the site (no scheme, no host, not a fragment of the page itself)."""
    links = []
    for link in LINK.findall(page.read_text(encoding="utf-8")):
        parts = urlsplit(link)
        if not (parts.scheme or parts.netloc or link.startswith("#") or not parts.path):
            links.append(link)
    return links


def test_every_internal_link_names_a_file(site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= 20 and (site / "getting-started.html").is_file()
    broken = []
    for page in pages:
        if page.name == "404.html":
            continue  # a server shows it at any missing address: its links are absolute by design (MkDocs)
        for link in internal_links(page):
            target = (page.parent / unquote(urlsplit(link).path)).resolve()
            if link.endswith("/") or not target.is_file():
                broken.append(f"{page.relative_to(site)}: {link}")
    assert broken == []


def launch(playwright):
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: CI installs Debian's chromium (.ci/run)")
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    return playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])


def test_a_navigation_link_opens_its_page_from_disk(site):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = launch(playwright)
        context = browser.new_context(viewport={"width": 1280, "height": 900}, offline=True)
        context.route(re.compile(r"^(?!file://).*"), lambda route: route.abort())  # the web fonts: not needed here
        page = context.new_page()
        page.goto((site / "index.html").as_uri())
        page.wait_for_load_state("load")
        assert page.locator("article h1").first.inner_text().rstrip("¶") == "tatblimp-callback"
        page.locator('nav.md-nav--primary a.md-nav__link[href="getting-started.html"]').first.click()
        page.wait_for_load_state("load")
        assert page.url == (site / "getting-started.html").as_uri()
        assert page.locator("article h1").first.inner_text().rstrip("¶") == "Getting started"
        page.locator('nav.md-nav--primary a.md-nav__link[href="reference/cli.html"]').first.click()
        page.wait_for_load_state("load")
        assert page.url == (site / "reference" / "cli.html").as_uri()
        assert page.locator("article h2#tatblimp").count() == 1  # the generated reference, not a folder listing

        # Getting started at 1280 pixels: what a reader copies or compares fits without scrolling sideways.
        page.goto((site / "getting-started.html").as_uri())
        page.wait_for_load_state("load")
        overflowing = page.evaluate(
            """() => [...document.querySelectorAll('article .md-typeset__scrollwrap, article .highlight pre > code')]
                .filter(e => e.tagName != 'CODE' || /^(make|pip|tatblimp) /.test(e.innerText))  // the shell blocks
                .filter(e => e.scrollWidth > e.clientWidth + 1)
                .map(e => (e.innerText || '').slice(0, 60))"""
        )
        browser.close()
    assert overflowing == []


def test_search_finds_a_page_in_the_site_opened_from_disk(site):
    """Material's offline plugin and the vendored iframe-worker shim: without them the box says "Initializing search"
    forever from file:// (no fetch of the index, no worker), and the shim would be loaded from unpkg.com."""
    from playwright.sync_api import sync_playwright

    asked = []
    with sync_playwright() as playwright:
        browser = launch(playwright)
        context = browser.new_context(viewport={"width": 1280, "height": 900}, offline=True)
        context.route(re.compile(r"^(?!file://).*"), lambda route: (asked.append(route.request.url), route.abort()))
        page = context.new_page()
        failed = []
        page.on("requestfailed", lambda request: failed.append(request.url))
        page.goto((site / "guides" / "diagnostics.html").as_uri())  # a page below the top: relative paths to the index
        page.wait_for_load_state("load")
        page.locator("input.md-search__input").fill("McNemar")  # in the header at 1280 px
        results = page.locator(".md-search-result__item")
        results.first.wait_for(timeout=20_000)
        meta = page.locator(".md-search-result__meta").inner_text()
        first = results.first.locator("a").first
        href = first.get_attribute("href")
        first.click()
        page.wait_for_load_state("load")
        url = page.url
        browser.close()
    assert re.fullmatch(r"\d+ matching documents?", meta), meta
    assert href and not href.startswith(("http", "/"))
    assert url.startswith(site.as_uri()) and Path(unquote(urlsplit(url).path)).is_file()
    assert [u for u in failed if u.startswith("file://")] == []  # search/search_index.js and the shim were there
    assert not any("unpkg.com" in u or "iframe-worker" in u for u in asked)  # the shim from disk, not the network
