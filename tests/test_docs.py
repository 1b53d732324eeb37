"""The documentation site (docs/, Sphinx with MyST): it builds with warnings as errors, every code block in it and
in the README is run by a named test or says why it is not, and the built site reads as a reader sees it in
headless Chromium (the home page and a tutorial render, and the navigation lists every page)."""

import html.parser
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import ROOT, import_from

DOCS = ROOT / "docs"
PAGES = sorted(path for path in DOCS.rglob("*.md") if "_build" not in path.parts)
# A block's marker, on the line before its opening fence: the test that reads the block from this file and runs it,
# or why it does not run here. A ```text block is what a command prints, not something to run.
RUNS = re.compile(r"<!-- runs in (tests/[\w/]+\.py)::(\w+) -->")
NOT_RUN = re.compile(r"<!-- not run here(?: as written)?: (.{12,}) -->")  # "as written": a test runs a variant
FENCE = re.compile(r"^```(\S*)", re.M)


def readme_build_command() -> list[str]:
    """The README's ``sphinx-build`` line, without its ``uv run``."""
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if "sphinx-build" in line
                and line.startswith("uv run"))
    return line.split()[2:]


@pytest.fixture(scope="session")
def site(tmp_path_factory):
    """The site built once into an empty folder by the README's command (``-W``: warnings are errors)."""
    out = tmp_path_factory.mktemp("site")
    command = readme_build_command()
    assert command[0] == "sphinx-build" and "-W" in command and command[-1] == "docs/_build/html", command
    binary = Path(sys.executable).parent / "sphinx-build"
    built = subprocess.run([str(binary), *command[1:-1], "--keep-going", str(out)], cwd=ROOT, capture_output=True,
                           text=True, timeout=600)
    assert built.returncode == 0, f"sphinx-build -W failed:\n{built.stderr[-6000:]}"
    return out


def test_the_site_builds_with_warnings_as_errors_and_has_every_page(site):
    for page in PAGES:
        assert (site / page.relative_to(DOCS).with_suffix(".html")).is_file(), page
    config = (site / "reference" / "config.html").read_text()
    for field in ("learning_rate", "deterministic", "engine_push", "stages"):  # generated from the pydantic models
        assert f"<code class=\"docutils literal notranslate\"><span class=\"pre\">{field}</span></code>" in config
    api = (site / "reference" / "api" / "dew.collection.html").read_text()
    assert 'id="dew.collection.scheduler.RolloutScheduler"' in api  # generated from the docstrings
    harbor = (site / "reference" / "api" / "dew_harbor.html").read_text()  # Harbor itself mocked, not installed
    assert 'id="dew_harbor.bubblewrap.BubblewrapEnvironment"' in harbor
    images = {path.name for path in (DOCS / "images").iterdir()}  # sphinx -W refuses a missing one; not a stray one
    shown_anywhere = {name for page in PAGES for name in re.findall(r"images/([^)\s]+)", page.read_text())}
    assert not images - shown_anywhere, f"images no page shows: {sorted(images - shown_anywhere)}"


def code_blocks(path: Path):
    """(line, info string, the line before the fence) of every fenced block of a Markdown file."""
    lines = path.read_text().splitlines()
    inside, found = False, []
    for number, line in enumerate(lines):
        match = FENCE.match(line)
        if not match:
            continue
        if not inside:
            before = next((lines[k] for k in range(number - 1, -1, -1) if lines[k].strip()), "")
            found.append((number + 1, match.group(1), before))
        inside = not inside
    return found


def test_every_code_block_runs_in_a_named_test_or_says_why_not():
    unmarked = []
    for path in [ROOT / "README.md", *PAGES]:
        where = path.relative_to(ROOT).as_posix()
        for line, info, before in code_blocks(path):
            if info == "text" or info.startswith("{"):  # printed output; a Sphinx directive
                continue
            runs = RUNS.search(before)
            if runs:
                test_file, test = ROOT / runs.group(1), runs.group(2)
                source = test_file.read_text() if test_file.is_file() else ""
                assert f"def {test}(" in source, f"{where}:{line} names {runs.group(1)}::{test}, which does not exist"
                assert where in source, f"{where}:{line}: {runs.group(1)} does not read {where}"
            elif not NOT_RUN.search(before):
                unmarked.append(f"{where}:{line}")
    assert not unmarked, ("code blocks without a '<!-- runs in tests/FILE.py::TEST -->' or '<!-- not run here[ as "
                          f"written]: REASON -->' marker on the line before: {unmarked}")


class _Links(html.parser.HTMLParser):
    """The internal links inside the navigation sidebar (Furo's ``sidebar-tree``) of a rendered page."""

    def __init__(self):
        super().__init__()
        self.depth, self.links = 0, []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if self.depth:
            self.depth += tag not in ("img", "br", "input", "use")
            if tag == "a" and "internal" in (attrs.get("class") or ""):
                self.links.append(attrs["href"].split("#")[0])
        elif "sidebar-tree" in (attrs.get("class") or "").split():
            self.depth = 1

    def handle_endtag(self, tag):
        if self.depth:
            self.depth -= 1


def test_the_home_page_and_a_tutorial_render_in_chromium(site, tmp_path):
    browser_env = import_from("tools", "browser_env")
    try:
        browser = browser_env.ensure()
    except browser_env.ContainerEngineError as error:
        pytest.fail(f"the documentation test needs a headless Chromium: {error}")
    headless = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,900"]
    for page in ("index.html", "tutorials/own-model.html"):
        shot = tmp_path / (page.replace("/", "_") + ".png")
        ran = subprocess.run([*headless, f"--screenshot={shot}", (site / page).as_uri()], capture_output=True,
                             text=True, timeout=120)
        assert ran.returncode == 0 and shot.is_file(), ran.stderr[-2000:]
        pixels = np.asarray(Image.open(shot).convert("L"), dtype=np.float32)
        assert pixels.shape == (900, 1280)
        dark = (pixels < 128).mean()  # text and the sidebar's links on a light page
        assert 0.005 < dark < 0.5 and pixels.std() > 10, (page, dark, pixels.std())
    dom = subprocess.run([*headless, "--dump-dom", (site / "index.html").as_uri()], capture_output=True, text=True,
                         timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    parser = _Links()
    parser.feed(dom.stdout)
    listed = set(parser.links)
    pages = {page.relative_to(DOCS).with_suffix(".html").as_posix() for page in PAGES} - {"index.html"}
    assert pages <= listed, f"pages the navigation does not list: {sorted(pages - listed)}"


def test_every_link_of_the_readme_reaches_a_file():
    """The README is read on its own (on a forge, from a checkout), outside the site's -W build."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert len(links) >= 20, links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path = link.split("#")[0]
        assert (ROOT / path).exists(), f"README.md links to {link}, which is not in the repository"
