"""Sphinx configuration of Sluice's documentation: Markdown pages (MyST)
with the Furo theme. `make docs` builds it into build/docs; the test suite
builds it with warnings as errors (tests/unit/test_docs.py). Nothing here
reaches the network: no intersphinx, no remote images."""

project = "Sluice"
author = "Sluice contributors"
copyright = "Sluice contributors"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# GitHub-style anchors for headings down to ####, so that links such as
# redis.md#redis-cluster work on GitHub and in the built site alike.
myst_heading_anchors = 4

html_theme = "furo"
html_title = "Sluice"
html_copy_source = False
html_show_sourcelink = False
