"""Every document a file of the repository cites exists, with its section where one is named."""

from __future__ import annotations

import re
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent

#: Text files scanned for citations, by suffix (and the extension-less CI script).
TEXT_SUFFIXES = {".md", ".py", ".cu", ".cuh", ".cfg", ".toml", ".txt", ".sh", ".json"}
#: Folders never scanned: virtual environments, caches, build output.
SKIPPED_DIRS = {"__pycache__", "build", "dist", "node_modules"}

#: Citations of documents that other work in progress removes or writes, as (citing file,
#: cited document). Each is expected to be missing; when its fix lands the test fails until
#: the entry is removed here, so that the list cannot outlive its reasons.
KNOWN_MISSING: set[tuple[str, str]] = set()

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # markdown links and images: their target
_DOCUMENT = re.compile(r"(?<![\w/.\-])((?:[\w.\-]+/)*[\w.\-]+\.md)(?:#([\w\-]+))?")  # a .md path, maybe #section
_URL = re.compile(r"[a-z][a-z0-9+.\-]*://\S+")
_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def text_files(root: Path = ROOT) -> list[Path]:
    """Every text file of the repository below ``root``, hidden folders (a .venv, .git,
    caches) left out but for .ci."""
    found = []
    for path in sorted(root.rglob("*")):
        parts = path.relative_to(root).parts
        if any(p in SKIPPED_DIRS or p.endswith(".egg-info") or (p.startswith(".") and p != ".ci") for p in parts[:-1]):
            continue
        if path.is_file() and (path.suffix in TEXT_SUFFIXES or (parts[0] == ".ci" and not path.suffix)):
            found.append(path)
    return found


def slug(heading: str) -> str:
    """The anchor GitHub gives a markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (code blocks left out)."""
    found, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := _HEADING.match(line)):
            found.add(slug(m[2]))
    return found


def citations(path: Path) -> set[tuple[str, str | None]]:
    """(target, section) of every document ``path`` cites: a markdown file's links and
    images (any target but URLs and bare #sections), and in every file each path ending in .md."""
    text = path.read_text(encoding="utf-8", errors="replace")
    found: set[tuple[str, str | None]] = set()
    if path.suffix == ".md":
        for target in _LINK.findall(text):
            if _URL.match(target) or target.startswith(("#", "mailto:")):
                continue
            name, _, section = target.partition("#")
            found.add((name, section or None))
    for m in _DOCUMENT.finditer(_URL.sub(" ", text)):
        found.add((m[1], m[2]))
    return found


def missing(root: Path = ROOT) -> dict[tuple[str, str], str]:
    """{(citing file, cited document): what is wrong} over every text file below ``root``
    but this one (whose strings are the scan's own examples). A citation resolves from the
    citing file's folder, or else from the repository's root."""
    problems = {}
    for path in text_files(root):
        if path.resolve() == Path(__file__).resolve():
            continue
        for target, section in citations(path):
            candidates = [path.parent / target, root / target]
            found = next((c for c in candidates if c.exists()), None)
            key = (path.relative_to(root).as_posix(), target)
            if found is None:
                problems[key] = "no such file"
            elif section and found.suffix == ".md" and section not in anchors(found):
                problems[key] = f"no section #{section} in {found.relative_to(root).as_posix()}"
    return problems


def test_every_cited_document_exists() -> None:
    problems = missing()
    unexpected = {key: why for key, why in problems.items() if key not in KNOWN_MISSING}
    fixed = KNOWN_MISSING - problems.keys()
    assert not unexpected, "citations of missing documents:\n" + "\n".join(
        f"  {file}: {target} ({why})" for (file, target), why in sorted(unexpected.items()))
    assert not fixed, ("these citations resolve now; remove them from KNOWN_MISSING in tests/test_docs.py: "
                       + ", ".join(f"{file}: {target}" for file, target in sorted(fixed)))


def test_the_scan_finds_missing_documents_and_sections(tmp_path) -> None:
    gone = "gone" + ".md"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "real.md").write_text("# Real\n\n## A section\n\n```\n# not a heading\n```\n")
    (tmp_path / "code.py").write_text(f'"""The rule of {gone} section 2; see docs/real.md#a-section."""\n')
    (tmp_path / "page.md").write_text(
        "[ok](docs/real.md) [bad section](docs/real.md#not-a-heading) ![plot](plots/x.png) "
        "[web](https://example.com/" + gone + ") [here](#top)\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "site.md").write_text(f"[x]({gone})")
    assert missing(tmp_path) == {
        ("code.py", gone): "no such file",
        ("page.md", "docs/real.md"): "no section #not-a-heading in docs/real.md",
        ("page.md", "plots/x.png"): "no such file",
    }


def test_slugs_are_githubs() -> None:
    assert slug("API and semantics in brief") == "api-and-semantics-in-brief"
    assert slug("Use from NumPy, CuPy, PyTorch and JAX") == "use-from-numpy-cupy-pytorch-and-jax"
    assert slug("`flashcupy.testing`: fuzzing") == "flashcupytesting-fuzzing"
