"""docs/architecture.md is the map of the package: every file path it cites in backticks exists,
and every subpackage of ``mini_paged_attn`` is named in it, so a move or a new package that
forgets the map fails here. docs/from-the-seeds.md, which maps the seeds' names to ours, must
cite real paths too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "mini_paged_attn"
MAP = REPO / "docs" / "architecture.md"
# Documents whose backticked paths must all exist.
CITING = [MAP, REPO / "docs" / "from-the-seeds.md"]

# A backticked span that reads as a path: no spaces, a slash or a file suffix. HTTP routes
# (``/v1/...``) start with a slash and are not files.
_SPAN = re.compile(r"`([^`\n]+)`")
_PATHLIKE = re.compile(r"^[A-Za-z0-9_.\-/]+$")
_SUFFIXES = (".py", ".md", ".sh", ".toml", ".json")


def cited_paths(text: str) -> list[str]:
    """The backticked spans of ``text`` that name a file or a folder, in order."""
    found = []
    for span in _SPAN.findall(text):
        if not _PATHLIKE.match(span) or span.startswith("/") or "://" in span:
            continue
        if "/" in span or span.endswith(_SUFFIXES):
            found.append(span)
    return found


def resolves(span: str, repo: Path = REPO) -> bool:
    """Whether ``span`` names a file or folder relative to the repository or the package; a bare
    file name (no slash) may sit in any folder of the package."""
    package = repo / "mini_paged_attn"
    name = span.rstrip("/")
    if (repo / name).exists() or (package / name).exists():
        return True
    if "/" not in span:
        return any(package.rglob(name))
    return False


def subpackages(package: Path = PACKAGE) -> list[str]:
    """Every folder of the package with an ``__init__.py``, relative to it, as ``a/b``."""
    return sorted(str(init.parent.relative_to(package))
                  for init in package.rglob("__init__.py") if init.parent != package)


def named_packages(text: str) -> set[str]:
    """The packages the map names, each as a backticked folder: ``a/b/`` or
    ``mini_paged_attn/a/b/`` (a cited file inside it does not name the package)."""
    names: set[str] = set()
    for span in cited_paths(text):
        path = span.removeprefix("mini_paged_attn/")
        if path.endswith("/"):
            names.add(path.rstrip("/"))
    return names


def test_cited_paths_are_recognised():
    text = ("`engine/worker/model_runner.py`, `cli.py`, `docs/moe.md`, `engine/sample/`, "
            "`/v1/chat/completions`, `GET /metrics`, `(num_blocks, block_size)`, `LLM`")
    assert cited_paths(text) == ["engine/worker/model_runner.py", "cli.py", "docs/moe.md",
                                 "engine/sample/"]
    assert named_packages(text) == {"engine/sample"}


def test_resolves_against_repo_and_package():
    assert resolves("engine/worker/model_runner.py")
    assert resolves("mini_paged_attn/engine/worker/")
    assert resolves("tests/test_import_graph.py")
    assert resolves("input_batch.py")
    assert not resolves("engine/model_runner.py")
    assert not resolves("step_message.py")


@pytest.mark.parametrize("doc", CITING, ids=lambda doc: doc.name)
def test_every_cited_path_exists(doc):
    missing = [span for span in cited_paths(doc.read_text(encoding="utf-8")) if not resolves(span)]
    assert not missing, f"{doc.relative_to(REPO)} cites paths that do not exist: {missing}"


@pytest.mark.parametrize("package", subpackages())
def test_every_subpackage_is_on_the_map(package):
    assert package in named_packages(MAP.read_text(encoding="utf-8")), (
        f"docs/architecture.md does not name the package `{package}/`")
