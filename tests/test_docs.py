"""Every code block of the documentation runs, or says why it does not.

The blocks are the fenced code blocks of README.md and docs/**/*.md.  What the
test does with a block depends on its language and on the HTML comments right
before it (blank lines and other comments may stand between a marker and its
block):

* ``python`` blocks run in order in one Python process per page, a child
  forked from a warm Python (``tests/warm_python.py``: TensorFlow imported, the
  page's code not yet run) or a fresh one (a page
  is read top to bottom: a block may use what an earlier block of its page
  defined).  A block identical to one already run elsewhere (the README's
  example repeated in the docs) runs once.
* ``bash`` / ``sh`` blocks run command by command in bash (backslash
  continuations joined, comments skipped); every command must exit 0.
* ``console`` blocks hold ``$ command`` lines, each followed by the output it
  prints; the output (stdout and stderr) must match: a line ``...`` stands for
  any lines, ``...`` inside a line for any text.  The exit code is not checked
  (a refusal's one line is its proof).
* ``text`` blocks are output shown to the reader and are not run; ``toml`` and
  ``json`` blocks are files and must parse.
* A block without a language, or in any other language, must be marked
  not-run.

Markers (HTML comments, invisible on GitHub and in the site):

* ``<!-- not-run: REASON -->``: the block is not run; REASON says why (how long
  it takes, what it needs) and, where one exists, which test runs the same code.
* ``<!-- test-replace: OLD => NEW -->``: OLD, which must occur in the block, is
  replaced by NEW before the block runs -- tiny settings for a block that
  trains (``epochs=300 => epochs=2``).  Several may precede one block.
* ``<!-- test-expect: TEXT -->``: the block's output must contain TEXT.

Blocks run in a temporary directory (fresh per page or shell block) that holds
links to the repository's ``experiments/``, ``models/`` and ``notebooks/``, so
repository paths work and nothing is written into the checkout.  This checkout
comes first on PYTHONPATH, ``dpfl-tf`` on PATH runs it (``python -m
dpfl_tf``, forked from the test process's warm Python for this environment when
it has one), the data are found as the rest of the suite finds them
(``DPFL_DATA_DIR``, set by conftest.py), downloads are off, and the cache is a
temporary directory.  Runnable blocks run two at a time
(``DPFL_DOCS_TEST_WORKERS``).  A command that installs packages (``pip``,
``apt-get``, ``sudo``) must be marked not-run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests import warm_python

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINKED = ("experiments", "models", "notebooks")
TIMEOUT = 900  # seconds for one page or one shell block
WORKERS = int(os.environ.get("DPFL_DOCS_TEST_WORKERS", "2"))

PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell"}
CONSOLE = {"console"}
DATA = {"toml", "json"}
SHOWN = {"text"}

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+)(?P<info>[^`\n]*)$")
MARKER = re.compile(
    r"^\s*<!--\s*(?P<name>not-run|test-replace|test-expect)\s*:(?P<value>.*?)"
    r"-->\s*$"
)
OTHER_COMMENT = re.compile(r"^\s*<!--.*-->\s*$")
INSTALLS = re.compile(r"(^|[;&|]\s*)(sudo|pip3?|apt-get|apt)\s")


@dataclasses.dataclass
class Block:
    page: pathlib.Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    not_run: str | None = None
    replace: list = dataclasses.field(default_factory=list)
    expect: list = dataclasses.field(default_factory=list)
    problems: list = dataclasses.field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.not_run is None and self.lang in PYTHON | SHELL | CONSOLE

    def code_to_run(self) -> str:
        code = self.code
        for old, new in self.replace:
            code = code.replace(old, new)
        return code


def _markers_before(lines: list[str], index: int) -> list[re.Match]:
    """The marker comments above line `index`, up to the first line that is
    neither blank nor an HTML comment."""
    found = []
    i = index - 1
    while i >= 0 and (not lines[i].strip() or OTHER_COMMENT.match(lines[i])):
        m = MARKER.match(lines[i])
        if m:
            found.append(m)
        i -= 1
    return found[::-1]


def parse_blocks(page: pathlib.Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = len(m["indent"]), m["fence"], m["info"].strip()
        j = i + 1
        while j < len(lines) and not re.match(rf"^ {{0,{indent + 3}}}{fence}\s*$", lines[j]):
            j += 1
        body = "\n".join(
            line[indent:] if line[:indent].strip() == "" else line for line in lines[i + 1 : j]
        )
        block = Block(page, i + 1, info.split()[0].lower() if info else "", body + "\n")
        for marker in _markers_before(lines, i):
            value = marker["value"].strip()
            if marker["name"] == "not-run":
                block.not_run = value
                if len(value.split()) < 3:
                    block.problems.append(f"not-run needs a reason, got {value!r}")
            elif marker["name"] == "test-replace":
                old, sep, new = value.partition("=>")
                old, new = old.strip(), new.strip()
                if not sep or not old:
                    block.problems.append(f"test-replace must be 'OLD => NEW', got {value!r}")
                elif old not in block.code:
                    block.problems.append(f"test-replace: {old!r} does not occur in the block")
                block.replace.append((old, new))
            else:
                block.expect.append(value)
        if block.not_run is None:
            if not block.lang:
                block.problems.append(
                    "a block without a language must be marked not-run "
                    "(say what it is, or why it does not run)"
                )
            elif block.lang not in PYTHON | SHELL | CONSOLE | DATA | SHOWN:
                block.problems.append(
                    f"```{block.lang} blocks are not run: mark it not-run with the reason"
                )
            elif block.lang in SHELL | CONSOLE and INSTALLS.search(block.code):
                block.problems.append("installs packages: mark it not-run")
        if block.not_run is not None and (block.replace or block.expect):
            block.problems.append("a not-run block has test-replace / test-expect markers")
        blocks.append(block)
        i = j + 1
    return blocks


BLOCKS = [b for page in PAGES for b in parse_blocks(page)]


def _first_of_duplicates(blocks: list[Block]) -> dict[int, Block]:
    """id(block) -> the earlier runnable Python block with the same code."""
    seen, out = {}, {}
    for b in blocks:
        if b.runnable and b.lang in PYTHON:
            key = b.code_to_run()
            if key in seen:
                out[id(b)] = seen[key]
            else:
                seen[key] = b
    return out


DUPLICATES = _first_of_duplicates(BLOCKS)


# -- running -----------------------------------------------------------------
class Sandbox:
    """A temporary working directory and the environment blocks run in."""

    def __init__(self):
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="dpfl_tf_docs_"))
        for name in LINKED:
            (self.dir / name).symlink_to(ROOT / name, target_is_directory=True)
        bin_dir = self.dir / ".bin"
        bin_dir.mkdir()
        shim = bin_dir / "dpfl-tf"
        # a warm Python when the test process has one for this environment
        shim.write_text(
            f'#!/bin/sh\nexec "{sys.executable}" -m tests.warm_python -m dpfl_tf "$@"\n'
        )
        shim.chmod(0o755)
        cache = self.dir / ".cache"
        cache.mkdir()
        self.env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "DPFL_NO_DOWNLOAD": "1",
            "DPFL_CACHE_DIR": str(cache),
            "MPLBACKEND": "Agg",
            "FLWR_TELEMETRY_ENABLED": "0",
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "PYTHONUNBUFFERED": "1",
        }

    def remove(self):
        shutil.rmtree(self.dir, ignore_errors=True)


_RUNNER = """
import sys, traceback
blocks = {blocks!r}
namespace = {{"__name__": "__main__"}}
for where, code in blocks:
    print(f"\\n=== {{where}}", flush=True)
    try:
        exec(compile(code, where, "exec"), namespace)
    except SystemExit as e:
        if e.code not in (0, None):
            traceback.print_exc()
            print(f"BLOCK FAILED: {{where}}", flush=True)
            sys.exit(1)
    except BaseException:
        traceback.print_exc()
        print(f"BLOCK FAILED: {{where}}", flush=True)
        sys.exit(1)
"""


def run_python_page(blocks: list[Block]) -> tuple[bool, str]:
    box = Sandbox()
    try:
        script = _RUNNER.format(blocks=[(b.where, b.code_to_run()) for b in blocks])
        proc = warm_python.run(
            [sys.executable, "-c", script],
            cwd=box.dir,
            env=box.env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        out = proc.stdout + proc.stderr
        ok = proc.returncode == 0 and all(e in out for b in blocks for e in b.expect)
        return ok, out
    finally:
        box.remove()


def shell_commands(code: str) -> list[str]:
    commands, current = [], ""
    for line in code.split("\n"):
        if current:
            current += "\n" + line
        elif line.strip() and not line.lstrip().startswith("#"):
            current = line
        if current and not current.endswith("\\"):
            commands.append(current)
            current = ""
    if current:
        commands.append(current)
    return commands


def console_steps(code: str) -> list[tuple[str, list[str]]]:
    steps = []
    for line in code.rstrip("\n").split("\n"):
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
        elif line.strip():
            raise ValueError(f"console block output before any '$ ' command: {line!r}")
    return steps


def output_matches(expected: list[str], actual: str) -> bool:
    while expected and not expected[-1].strip():
        expected = expected[:-1]
    parts = []
    for line in expected:
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*".join(re.escape(p) for p in line.rstrip().split("...")) + r"[ \t]*\n")
    pattern = "".join(parts)
    text = "\n".join(line.rstrip() for line in actual.strip("\n").split("\n")) + "\n"
    return re.fullmatch(pattern, text, re.S) is not None


def run_shell_block(block: Block) -> tuple[bool, str]:
    box = Sandbox()
    log = []
    try:
        code = block.code_to_run()
        if block.lang in CONSOLE:
            steps = console_steps(code)
        else:
            steps = [(c, None) for c in shell_commands(code)]
        ok = True
        for command, expected in steps:
            proc = subprocess.run(
                ["bash", "-c", command],
                cwd=box.dir,
                env=warm_python.for_descendants(box.env),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=TIMEOUT,
            )
            log.append(f"$ {command}\n{proc.stdout}[exit {proc.returncode}]")
            if expected is None:
                ok = ok and proc.returncode == 0
            elif not output_matches(expected, proc.stdout):
                log.append("expected:\n" + "\n".join(expected))
                ok = False
            if not ok:
                break
        out = "\n".join(log)
        ok = ok and all(e in out for e in block.expect)
        return ok, out
    finally:
        box.remove()


def _units() -> dict[str, tuple]:
    """Everything that runs: one unit per page of Python blocks, one per shell block."""
    units = {}
    for page in PAGES:
        python = [
            b
            for b in BLOCKS
            if b.page == page and b.runnable and b.lang in PYTHON and id(b) not in DUPLICATES
        ]
        if python:
            units[str(page.relative_to(ROOT))] = (run_python_page, python)
    for b in BLOCKS:
        if b.runnable and b.lang in SHELL | CONSOLE:
            units[b.where] = (run_shell_block, b)
    return units


UNITS = _units()


@pytest.fixture(scope="module")
def results(request):
    """Runs the selected units, WORKERS at a time, as soon as the first one is asked for."""
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_block_runs" and hasattr(item, "callspec")
    ]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, WORKERS))
    futures = {name: pool.submit(UNITS[name][0], UNITS[name][1]) for name in selected}
    yield futures
    pool.shutdown(cancel_futures=True)


# -- tests -------------------------------------------------------------------
def test_the_docs_have_runnable_blocks():
    assert any(b.runnable for b in BLOCKS if b.page.name == "README.md")
    assert sum(b.runnable for b in BLOCKS) >= 10


def test_every_page_has_a_title_and_a_body():
    """An emptied or truncated page still builds under mkdocs --strict: caught here."""
    texts = {str(page.relative_to(ROOT)): page.read_text() for page in PAGES}
    short = [p for p, t in texts.items() if not t.startswith("# ") or len(t.splitlines()) < 5]
    assert not short, f"pages without a '# ' title or under 5 lines: {short}"


def test_every_block_runs_or_says_why():
    problems = [f"{b.where} (```{b.lang}): " + "; ".join(b.problems) for b in BLOCKS if b.problems]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if b.not_run is None and b.lang in DATA], ids=lambda b: b.where
)
def test_file_blocks_parse(block):
    if block.lang == "toml":
        if tomllib is None:
            pytest.skip("tomllib needs Python >= 3.11")
        tomllib.loads(block.code)
    else:
        json.loads(block.code)


@pytest.mark.parametrize("name", sorted(UNITS))
def test_block_runs(name, results):
    ok, out = results[name].result(timeout=4 * TIMEOUT)
    assert ok, f"{name}:\n{out[-6000:]}"


def test_the_readme_test_command_is_the_one_ci_runs():
    """.ci/run runs the command between the README's test-command markers."""
    text = (ROOT / "README.md").read_text()
    marked = re.search(
        r"<!-- test-command -->\n```\n(.*?)\n```\n<!-- /test-command -->", text, re.S
    )
    assert marked and marked.group(1) == (
        'pip install -e ".[test]" && python -m pytest -q -n 2 --dist loadfile'
    )  # the whole suite: no -m / -k selection
    assert "test-command" in (ROOT / ".ci" / "run").read_text()
