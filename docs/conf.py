"""Sphinx configuration of dew-ray's documentation site (MyST Markdown pages, the Furo theme).

Build it with ``uv run sphinx-build -W -b html docs docs/_build/html``; ``tests/test_docs.py``
does, with warnings as errors, so a broken link, a missing page or a docstring autodoc cannot
read fails the suite.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "dew-ray"
author = "the dew-ray authors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "dew_docs"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the signatures stay readable; docstrings say what each argument is
autodoc_default_options = {"show-inheritance": True}
# dew_harbor's plug-ins subclass Harbor's classes and run in Harbor's own environment, not the project's
autodoc_mock_imports = ["harbor"]

html_theme = "furo"
html_title = "dew-ray"
html_static_path = []
