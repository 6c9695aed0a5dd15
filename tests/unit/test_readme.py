"""The README and docs/ show real things: every `--help` output they show lists real config groups
(with their real options) and real keys (with the value that command line composes), and every
relative link they hold leads to a file. In-process: Hydra's compose API over the real conf/."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rlsync.errors import show  # how --help writes a value

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SHOWN = [README, DOCS / "config.md"]  # the pages that show --help outputs

# The primary config of each command (rlsync/conf/<name>.yaml).
CONFIG_OF = {"rlsync": "config", "rlsync.bench": "bench", "rlsync.serve": "engine", "rlsync.plan": "plan"}
SCRIPTS = {
    "rlsync": "rlsync",
    "rlsync-bench": "rlsync.bench",
    "rlsync-serve": "rlsync.serve",
    "rlsync-plan": "rlsync.plan",
}

COMMAND = re.compile(r"^\$ (?:python -m (?P<module>[\w.]+)|(?P<script>rlsync[\w-]*))(?P<args>(?: \S+)*?) --help$")
GROUP_LINE = re.compile(r"^(?P<group>[a-z_]+): (?P<options>[\w, ]+)$")
KEY_LINE = re.compile(r"^  (?P<key>[a-z_]+(?:\.[a-z_0-9]+)+)=(?P<value>\S*)(?:  +(?P<comment>.*))?$")
LINK = re.compile(r"\]\((?P<target>[^)#\s]+)(?:#[^)]*)?\)")


@dataclass
class HelpBlock:
    """One `$ ... --help` code block as a page shows it."""

    page: str
    line: int
    module: str
    overrides: list[str]
    groups: dict[str, list[str]] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)


def help_blocks(text: str, page: str = "page") -> list[HelpBlock]:
    """The `--help` outputs in a markdown page's indented code blocks: the command, the groups listed
    under "== Config groups" and every `  key=value  comment` line ("..." marks lines left out)."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = COMMAND.match(lines[i][4:]) if lines[i].startswith("    $ ") else None
        if not m:
            i += 1
            continue
        module = m["module"] or SCRIPTS[m["script"]]
        block = HelpBlock(page, i + 1, module, m["args"].split())
        in_groups, i = False, i + 1
        while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
            body = lines[i][4:]
            if body.startswith("$ "):
                break  # the next command in the same code block
            if body.startswith("== "):
                in_groups = body.startswith("== Config groups")
            elif in_groups and GROUP_LINE.match(body):
                g = GROUP_LINE.match(body)
                block.groups[g["group"]] = [o.strip() for o in g["options"].split(",")]
            elif KEY_LINE.match(body):
                k = KEY_LINE.match(body)
                block.keys[k["key"]] = k["value"]
            i += 1
        blocks.append(block)
    return blocks


@pytest.fixture(scope="module")
def hydra_conf():
    """(real groups {group: options}, compose(config_name, overrides) -> plain dict) over the real conf/."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from rlsync.config.compose import register_configs

    register_configs()  # the schemas the primary configs start from, and the help's resolvers

    def groups() -> dict[str, list[str]]:
        loader = GlobalHydra.instance().config_loader()
        return {g: sorted(loader.get_group_options(g)) for g in loader.list_groups("") if g != "hydra"}

    def composed(config_name: str, overrides: list[str]) -> dict:
        cfg = compose(config_name=config_name, overrides=overrides)
        return OmegaConf.to_container(cfg, resolve=True)

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        yield groups(), composed


MISSING = object()


def lookup(tree: dict, key: str):
    node = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def problems(block: HelpBlock, real_groups: dict[str, list[str]], composed) -> list[str]:
    """What in a shown --help output is not what the command prints."""
    where = f"{block.page}:{block.line} (python -m {block.module} {' '.join(block.overrides)} --help)"
    out = []
    if block.module not in CONFIG_OF:
        return [f"{where}: no such command"]
    if block.groups and block.groups != real_groups:
        out.append(f"{where}: config groups shown {block.groups}, real {real_groups}")
    tree = composed(CONFIG_OF[block.module], block.overrides)
    for key, shown in block.keys.items():
        value = lookup(tree, key)
        if value is MISSING:
            out.append(f"{where}: {key} is not a key of {CONFIG_OF[block.module]}.yaml")
        elif show(value) != shown:
            out.append(f"{where}: {key}={shown} shown, the command line composes {key}={show(value)}")
    return out


def all_blocks() -> list[HelpBlock]:
    return [
        b for page in SHOWN for b in help_blocks(page.read_text(encoding="utf-8"), page.relative_to(ROOT).as_posix())
    ]


def test_the_readme_shows_a_help_output_with_groups_and_keys():
    readme = help_blocks(README.read_text(encoding="utf-8"), "README.md")
    assert readme, "README.md shows no `$ python -m rlsync ... --help` output"
    assert any(len(b.groups) >= 3 and len(b.keys) >= 5 for b in readme), [(b.groups, b.keys) for b in readme]
    every = all_blocks()
    assert {b.module for b in every} >= {"rlsync", "rlsync.bench", "rlsync.serve", "rlsync.plan"}  # docs/config.md
    assert sum(len(b.keys) for b in every) >= 80  # docs/config.md lists every key


def test_every_shown_help_group_and_key_is_real(hydra_conf):
    real_groups, composed = hydra_conf
    found = [p for block in all_blocks() for p in problems(block, real_groups, composed)]
    assert not found, "\n".join(found)


def test_the_check_catches_a_stale_help_output(hydra_conf):
    """Not trivially true: a group, an option, a key or a value that is not real is found."""
    real_groups, composed = hydra_conf
    stale = """
    $ python -m rlsync update.bucket_mb=64 --help
    == Config groups (GROUP=OPTION) ==
    model: qwen3_0p6b, tiny, qwen9
    == Keys (KEY=VALUE: ...) ==
    update: the weight update
      update.bucket_mb=512.0                  bucket size in MiB
      update.bucket_size=64.0                 a key that does not exist
      run.steps=6                             steps to run
"""
    (block,) = help_blocks(stale, "stale")
    assert block.overrides == ["update.bucket_mb=64"] and block.groups == {"model": ["qwen3_0p6b", "tiny", "qwen9"]}
    found = problems(block, real_groups, composed)
    assert len(found) == 3, found  # the groups, the value 512.0 (64.0 composed), the unknown key
    assert any("config groups shown" in p for p in found)
    assert any("update.bucket_mb=512.0 shown" in p and "update.bucket_mb=64.0" in p for p in found)
    assert any("update.bucket_size is not a key" in p for p in found)


def links(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    return [m["target"] for m in LINK.finditer(text) if not re.match(r"^[a-z]+:", m["target"])]


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_leads_to_a_file(page):
    missing = [t for t in links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to what does not exist: {missing}"


def test_the_readme_links_every_page_of_docs():
    text = README.read_text(encoding="utf-8")
    mentioned = set(re.findall(r"docs/[\w.-]+\.md", text))
    assert mentioned, "README.md links no page of docs/"
    missing = sorted(m for m in mentioned if not (ROOT / m).is_file())
    assert not missing, f"README.md names docs pages that do not exist: {missing}"
    unlinked = sorted(p.relative_to(ROOT).as_posix() for p in DOCS.glob("*.md"))
    unlinked = [p for p in unlinked if p not in mentioned]
    assert not unlinked, f"pages of docs/ the README does not link: {unlinked}"
