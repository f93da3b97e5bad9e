"""Build hooks of the documentation site (``hooks:`` in mkdocs.yml).

Figures and notebooks live where the experiments write them (``results/*.png``,
``notebooks/*.ipynb``), outside ``docs/``.  Rather than keep copies in git,
they are added to the site at build time:

* ``results/<name>.png`` becomes the site file ``assets/results/<name>.png``;
* ``notebooks/<name>.ipynb`` becomes ``tutorials/<name>.ipynb`` (rendered by
  mkdocs-jupyter with its stored outputs).

Pages link to them by their path in the repository (from
``docs/results/page.md``: ``../../results/mnist_fig3_training.png``), which
works on GitHub and in a clone; `on_page_markdown` rewrites those links to the
site's files.  A placeholder line ``<!-- cli-help: train -->`` is replaced by
the output of ``dpfl-tf train --help`` (the parser's own text, so the CLI
reference never goes stale).
"""

from __future__ import annotations

import io
import os
import pathlib
import re
from contextlib import redirect_stdout

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: repository folder -> (site folder, file suffix)
ADDED = {"results": ("assets/results", ".png"), "notebooks": ("tutorials", ".ipynb")}
LINK = re.compile(r"(\]\()([^)\s]+)(\))")
CLI_HELP = re.compile(r"^<!-- cli-help: (\w+) -->$", re.M)


@event_priority(50)  # before mkdocs-jupyter's on_files, which converts the notebooks
def on_files(files, config):
    for folder, (site_folder, suffix) in ADDED.items():
        for path in sorted((ROOT / folder).glob(f"*{suffix}")):
            files.append(
                File.generated(config, f"{site_folder}/{path.name}", abs_src_path=str(path))
            )
    return files


@event_priority(50)  # before mkdocs-jupyter's on_pre_page, which reads the path
def on_pre_page(page, config, files):
    # mkdocs-jupyter wraps each notebook's File; for a file added here the wrapper cannot
    # see the path it was added with, so it is handed over
    inner = getattr(page.file, "file", None)
    if inner is not None and page.file.__dict__.get("abs_src_path") is None:
        page.file.__dict__["abs_src_path"] = inner.abs_src_path
    return page


def _site_link(target: str, page_dir: pathlib.Path, docs_dir: pathlib.Path) -> str | None:
    """The link to the site's copy of a repository file, or None."""
    if "://" in target or target.startswith(("#", "/", "mailto:")):
        return None
    path, _, anchor = target.partition("#")
    resolved = pathlib.Path(os.path.normpath(page_dir / path))
    for folder, (site_folder, suffix) in ADDED.items():
        if resolved.parent == ROOT / folder and resolved.suffix == suffix:
            new = os.path.relpath(docs_dir / site_folder / resolved.name, page_dir)
            return new.replace(os.sep, "/") + (f"#{anchor}" if anchor else "")
    return None


def _cli_help(command: str) -> str:
    import sys

    if str(ROOT) not in sys.path:  # this checkout's parser, not an installed copy's
        sys.path.insert(0, str(ROOT))
    from dpfl_tf.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    out = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        with redirect_stdout(out):
            sub.print_help()
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    return f"```text\n$ dpfl-tf {command} --help\n{out.getvalue().rstrip()}\n```"


def on_page_markdown(markdown, page, config, files):
    docs_dir = pathlib.Path(config["docs_dir"]).resolve()
    page_dir = (docs_dir / page.file.src_uri).parent

    def link(m):
        new = _site_link(m.group(2), page_dir, docs_dir)
        return m.group(0) if new is None else f"{m.group(1)}{new}{m.group(3)}"

    markdown = LINK.sub(link, markdown)
    return CLI_HELP.sub(lambda m: _cli_help(m.group(1)), markdown)
