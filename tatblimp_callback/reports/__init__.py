"""The HTML report: one self-contained page with inline SVG charts."""
