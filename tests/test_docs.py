"""Every ```python block in README.md and docs/*.md runs.

The blocks of one file share a namespace and run in order, like one session,
in a temporary directory where `examples/` is the repository's: a guide's
code runs as a user would run it from the repository root, and what it
writes stays in the temporary directory. A block fenced ```python notest is
shown, not run (GPU-only code, downloads, long training); ```bash and other
blocks are never run.

The guides' code is backend-agnostic user code: CI runs it once, under
KERAS_BACKEND=jax (KBERT_DOCS_ALL_BACKENDS=1 runs it on any backend).
"""

import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(?P<info>[^`\n]*)\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)
LANGUAGES = {"python", "bash", "text", "json"}


def fenced_blocks(path):
    """(first line of the code, info words, code) for each fenced block."""
    text = path.read_text(encoding="utf-8")
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start("code")) + 1
        yield line, match["info"].split(), match["code"]


def python_blocks(path):
    return [
        (line, code)
        for line, info, code in fenced_blocks(path)
        if info[:1] == ["python"] and "notest" not in info
    ]


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_fences_name_a_language(path):
    """A typo in a fence (```pyhton, ```python no-test) would skip a block silently."""
    for line, info, _ in fenced_blocks(path):
        assert info and info[0] in LANGUAGES, f"{path.name}:{line}: fence needs one of {LANGUAGES}"
        assert info[1:] in ([], ["notest"]) and (info[1:] == [] or info[0] == "python"), (
            f"{path.name}:{line}: unknown fence options {info[1:]}; only ```python notest"
        )


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_python_blocks_run(path, tmp_path, monkeypatch):
    import keras

    if keras.backend.backend() != "jax" and not os.environ.get("KBERT_DOCS_ALL_BACKENDS"):
        pytest.skip("the guides run under KERAS_BACKEND=jax in CI")
    monkeypatch.chdir(tmp_path)
    os.symlink(ROOT / "examples", tmp_path / "examples")
    namespace = {"__name__": f"docs_{path.stem}"}
    for line, code in python_blocks(path):
        # Padded so that tracebacks give the line numbers of the Markdown file.
        exec(compile("\n" * (line - 1) + code, str(path), "exec"), namespace)
