"""MkDocs hook: the pages that map the package keep up with it.

- ``reference/api.md``: every public name of ``tatblimp_callback`` (its ``__all__``) has a
  ``::: tatblimp_callback...`` entry, so the API reference grows with the package.
- ``architecture.md``: every module of ``tatblimp_callback/`` is named (as ``layer/module.py``), so a new
  module gets its place in a layer.

A page that misses one fails the build, naming what is missing.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "tatblimp_callback"


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if page.file.src_uri == "reference/api.md":
        if str(REPO) not in sys.path:  # this checkout's package, as in cli_reference.py
            sys.path.insert(0, str(REPO))
        import tatblimp_callback

        entries = re.findall(r"^::: (tatblimp_callback[\w.]*)", markdown, re.MULTILINE)
        missing = sorted(set(tatblimp_callback.__all__) - {entry.rsplit(".", 1)[-1] for entry in entries})
        if missing:
            raise PluginError(f"reference/api.md has no '::: tatblimp_callback...' entry for: {', '.join(missing)}")
    elif page.file.src_uri == "architecture.md":
        # named by their path in the package (``engine/scoring.py``), so the page shows the folders too
        modules = {
            path.relative_to(PACKAGE).as_posix()
            for path in PACKAGE.rglob("*.py")
            if path.name not in ("__init__.py", "__main__.py")
        }
        missing = sorted(name for name in modules if not re.search(rf"\b{re.escape(name)}\b", markdown))
        if missing:
            raise PluginError(f"architecture.md does not name these modules of tatblimp_callback/: {', '.join(missing)}")
    return markdown
