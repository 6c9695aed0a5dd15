"""docs/layout.md's package map names every module and folder of rlsync: a module (each .py file under rlsync/ but
__init__ and __main__) by its file name in the entry of its folder, a folder by its name in the entry of the folder
above it, so a module added or moved without its line in the map fails here."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ROOT

PACKAGE = ROOT / "rlsync"
ENTRY_INDENT = 2  # `  report/          many runs -> ...`: an entry's name, two spaces in; its text runs on below it


def package_map(text: str) -> dict[str, str]:
    """The map's entries under `rlsync/`, by name (`report/`, `shell.py`): each one's lines joined, its name included."""
    block = text.split("\nrlsync/\n", 1)[1].split("\n```", 1)[0]
    entries: dict[str, str] = {}
    name = None
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip():
            continue
        if indent == 0:  # the next top-level line (experiments/, docs/, tests/): the package's map has ended
            break
        if indent == ENTRY_INDENT:
            name = line.split()[0]
            entries[name] = line
        elif name is not None:
            entries[name] += "\n" + line
    return entries


def where_named(path: Path, entries: dict[str, str]) -> tuple[str, str]:
    """(the entry that must name `path`, its text): its top folder's entry (`report/` for report/runs.py and for
    readers/frameworks/), or for a file directly under rlsync/ the entries of those files (errors.py's names fmt.py)."""
    parts = path.relative_to(PACKAGE).parts
    if len(parts) == 1:
        files = {name: text for name, text in entries.items() if not name.endswith("/")}
        return "rlsync/'s file entries", "\n".join(files.values())
    return f"{parts[0]}/", entries.get(f"{parts[0]}/", "")


MAP = package_map((ROOT / "docs" / "layout.md").read_text())
MODULES = sorted(
    p for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py") and "__pycache__" not in p.parts
)
FOLDERS = sorted({p.parent for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts} - {PACKAGE})


def test_the_map_is_read():
    """The parser finds the map's entries (a map it could not read would pass every check below vacuously)."""
    assert {"report/", "update/", "shell.py", "errors.py"} <= set(MAP), sorted(MAP)


@pytest.mark.parametrize("module", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_every_module_is_named_in_its_folders_entry(module: Path):
    entry, text = where_named(module, MAP)
    assert module.name in text, f"docs/layout.md: {entry} does not name {module.relative_to(ROOT)}"


@pytest.mark.parametrize("folder", FOLDERS, ids=[str(p.relative_to(PACKAGE)) for p in FOLDERS])
def test_every_folder_is_named(folder: Path):
    if folder.parent == PACKAGE:
        assert f"{folder.name}/" in MAP, f"docs/layout.md: no entry for rlsync/{folder.name}/"
    else:
        entry, text = where_named(folder, MAP)
        assert f"{folder.name}/" in text, f"docs/layout.md: {entry} does not name {folder.relative_to(ROOT)}/"
