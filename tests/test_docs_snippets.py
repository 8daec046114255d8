"""The documentation cannot drift from the code: README.md and docs/ are checked here.

- every ```python block marked ``<!-- runnable -->`` (the line before its fence) runs on CPU in a
  fresh process and exits 0 (tiny models built from configs; the Hub is off);
- the generated pages (settings and CLI references, the supported-models tables) equal what
  ``distca_hf.tools.docs_reference`` generates now (``make docs`` rewrites them);
- every phrase the troubleshooting page quotes from an error message is still in the package source;
- every relative link of README.md reaches a file, and an anchor a heading of that file;
- every ``distca-hf SUBCOMMAND --flag`` they write is a flag of that subcommand.

``make docs`` (mkdocs --strict) checks the links and anchors inside docs/ itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- runnable -->"


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def runnable_snippets() -> list[tuple[str, str]]:
    """``(where, code)`` of every ```python block whose fence follows a ``<!-- runnable -->`` line."""
    found = []
    for path in _documents():
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if line.strip() != MARKER:
                continue
            if i + 1 >= len(lines) or lines[i + 1].strip() != "```python":
                raise AssertionError(f"{path.relative_to(ROOT)}:{i + 1}: {MARKER} must be followed by a ```python fence")
            end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
            found.append((f"{path.relative_to(ROOT)}:{i + 2}", "\n".join(lines[i + 2 : end]) + "\n"))
    return found


SNIPPETS = runnable_snippets()


def test_the_quick_start_and_the_docs_have_runnable_snippets():
    where = [w.split(":")[0] for w, _ in SNIPPETS]
    assert "README.md" in where, "the README's quick start must be marked runnable"
    assert any(w.startswith("docs/") for w in where)


@pytest.fixture(scope="module")
def snippet_runs(tmp_path_factory):
    """Every runnable snippet started at once, each in a fresh interpreter on CPU from an empty
    folder (they overlap on the machine's cores); output goes to files, so no pipe can fill and block."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    runs = {}
    for where, code in SNIPPETS:
        folder = tmp_path_factory.mktemp("snippet")
        with open(folder / "output.txt", "w") as output:
            runs[where] = (subprocess.Popen([sys.executable, "-c", code], cwd=folder, env=env, stdout=output,
                                            stderr=subprocess.STDOUT), folder / "output.txt")
    yield runs
    for process, _ in runs.values():
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("where", [w for w, _ in SNIPPETS])
def test_runnable_snippet(where, snippet_runs):
    """The snippet runs alone and exits 0."""
    process, output = snippet_runs[where]
    code = process.wait(timeout=300)
    assert code == 0, f"{where} failed (exit {code}):\n{output.read_text()[-6000:]}"


def test_generated_pages_are_current():
    from distca_hf.tools.docs_reference import stale_pages

    assert stale_pages() == [], "regenerate them with `make docs` (python -m distca_hf.tools.docs_reference)"


def test_stale_pages_are_found(tmp_path):
    """The check above can fail: a copy whose settings page lost a line is stale, and rewriting fixes it."""
    from distca_hf.tools.docs_reference import PAGES, SECTIONS, stale_pages, write_pages

    for path, _ in SECTIONS:  # the hand-written pages that hold generated sections
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text((ROOT / path).read_text(encoding="utf-8"), encoding="utf-8")
    write_pages(tmp_path)
    assert stale_pages(tmp_path) == []
    settings = tmp_path / "docs/reference/settings.md"
    settings.write_text(settings.read_text(encoding="utf-8").replace("| `overlap` |", "| `overlap_mode` |"))
    assert stale_pages(tmp_path) == ["docs/reference/settings.md"]
    assert write_pages(tmp_path) == ["docs/reference/settings.md"]
    assert stale_pages(tmp_path) == []


def _message_texts() -> list[str]:
    """Every string literal of the package's code (not comments, not docstrings), an f-string with
    ``…`` for each placeholder; adjacent literals are one text, as Python joins them."""
    import ast

    texts = []
    for path in [*(ROOT / "distca_hf").rglob("*.py"), *(ROOT / "patches").rglob("*.py")]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        in_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                texts.append("".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values))
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                  and id(node) not in in_fstrings):
                texts.append(node.value)
    return texts


def test_troubleshooting_phrases_are_in_the_source():
    """Each row of the troubleshooting tables quotes a phrase of its error message (second column, in
    backticks, ``…`` where the message holds a value); the phrase must be in one of the package's
    string literals, so a reworded message fails here."""
    texts = _message_texts()
    quoted, header = [], None
    for line in (ROOT / "docs/troubleshooting.md").read_text(encoding="utf-8").splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if header is None:
            header = cells
        elif header == ["error", "message contains", "what to do"] and not cells[0].startswith("---"):
            phrases = re.findall(r"`([^`]+)`", cells[1])
            assert phrases, f"troubleshooting row without a quoted message phrase: {line[:100]}"
            quoted += phrases
    assert len(quoted) >= 40
    missing = [p for p in quoted if not any(p in text for text in texts)]
    assert not missing, f"phrases no error message of the package holds any more: {missing}"


def _anchors(markdown: str) -> set[str]:
    """The ids that mkdocs' toc extension gives the headings of a page (its own slugify)."""
    from markdown.extensions.toc import slugify

    headings = re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", markdown, flags=re.S), flags=re.M)
    return {slugify(re.sub(r"[`*]", "", h).strip(), "-") for h in headings}


def test_readme_links_reach_their_targets():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert len(local) >= 20
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README.md links to {path}, which does not exist"
        if anchor:
            assert anchor in _anchors(target.read_text(encoding="utf-8")), f"README.md: {path} has no heading #{anchor}"


def test_documented_command_flags_exist():
    """Every ``distca-hf SUBCOMMAND ... --flag`` written in README.md or docs/ names a flag that
    subcommand's parser takes (a renamed or dropped flag fails here, not in a user's shell)."""
    from distca_hf.tools import cli

    options = {name: {s for action in parser._actions for s in action.option_strings}  # argparse's own list
               for name, parser in cli.parsers().items()}
    commands, unknown = 0, []
    for path in _documents():
        text = path.read_text(encoding="utf-8").replace("\\\n", " ")  # shell line continuations
        for match in re.finditer(r"distca-hf (env|kernel-bench|simulate|profile|bench)((?: +\[?--?[a-z][\w-]*[^`\n|]*)*)",
                                 text):
            commands += 1
            unknown += [(path.name, match.group(1), flag)
                        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", match.group(2))
                        if flag not in options[match.group(1)]]
    assert commands >= 20
    assert not unknown, f"flags the commands do not take: {unknown}"
