"""README.md and docs/*.md stay true to the tree they describe.

Each check is a small function that returns what is wrong in one page's text (an empty list when nothing is),
so that a test can also feed it a made-up page and see it fail:

    broken_links("see [a](no/such/file.md)", ROOT)   -> ["no/such/file.md"]
    missing_paths("the loop is `trainer/loop.py`")   -> ["trainer/loop.py"]        (moved to trainer/run/)
    unknown_overrides(["train.no_such_key=N"], ...)  -> ["train.no_such_key=N"]

Checked in every page: relative links and images resolve (anchors included, as GitHub slugs its headings),
backticked repo paths and `python -m trainer.X` modules exist, and every override a page names (`key=VALUE` in
the first column of a table, backticked in the prose, or in a `trainer.train` command) is a key of the
composed Hydra config (or a config group and its option files). The README stays at
most README_MAX_CHARS characters and links every docs page.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs"
README = ROOT / "README.md"
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOC_PAGES]
README_MAX_CHARS = 12_000

REPO_PREFIXES = ("trainer/", "configs/", "tests/", "bench/", "scripts/", "launch/", "docs/")
PLACEHOLDER_CHARS = set("*<>{}")
FENCE = re.compile(r"^ {0,3}```.*?^ {0,3}```[^\n]*$", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
# A file named in a command of a code block: bench/packing.py, scripts/gpu_check.sh, ...
_PREFIXES = "|".join(re.escape(p) for p in REPO_PREFIXES)
CODE_PATH = re.compile(rf"(?<![\w./-])((?:{_PREFIXES})[\w./-]*\.(?:py|sh|sbatch|yaml|md|txt|png))\b")
MODULE_RUN = re.compile(r"-m\s+(trainer(?:\.\w+)+)")
DOTTED = re.compile(r"^trainer(?:\.\w+)+$")
URL_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", text)


def code_blocks(text: str) -> str:
    return "\n".join(m.group(0) for m in FENCE.finditer(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading:
    "The report: `python -m trainer.report`" -> "the-report-python--m-trainerreport"."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {slug(h) for h in HEADING.findall(prose(text))}


def broken_links(text: str, base: Path) -> list[str]:
    """Relative link and image targets in `text` that do not resolve from the folder `base`, anchors included.

    Example: broken_links("[x](missing.md) [y](https://example.org)", ROOT) -> ["missing.md"].
    """
    broken = []
    for target in LINK.findall(prose(text)):
        if URL_SCHEME.match(target):  # http(s):, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (base / path) if path else None
        if file is not None and not file.exists():
            broken.append(target)
        elif anchor:
            page = file.read_text(encoding="utf-8") if file is not None else text
            if file is not None and file.suffix != ".md":
                continue
            if anchor not in anchors(page):
                broken.append(target)
    return broken


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    """Repo paths that `text` names but `root` does not hold.

    Backticked spans that start with a repo folder (`trainer/run/step.py`, `configs/experiment/`) and hold no
    glob or placeholder character, files named in code blocks (`python bench/packing.py ...`), and the
    modules of `python -m trainer.X` or a backticked `trainer.X.Y` (a module, or a name defined in one).
    """
    missing = []
    spans = INLINE_CODE.findall(prose(text))
    for span in spans:
        words = span.split()
        token = words[0] if words else ""
        if (token.startswith(REPO_PREFIXES) and not PLACEHOLDER_CHARS & set(token)
                and not (root / token).exists()):
            missing.append(token)
    missing += [p for p in CODE_PATH.findall(code_blocks(text)) if not (root / p).exists()]
    dotted = MODULE_RUN.findall(text) + [s for s in spans if DOTTED.match(s)]
    missing += [name for name in dotted if not python_name_exists(name, root)]
    return sorted(set(missing), key=missing.index)


def python_name_exists(dotted: str, root: Path = ROOT) -> bool:
    """Whether `trainer.a.b` is a module or package under `root`, or a name defined in the longest such
    module."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:i])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if source.exists():
            rest = parts[i:]
            if not rest:
                return True
            if len(rest) > 1:  # module.Class.method: the class must exist; the method is not looked up
                rest = rest[:1]
            name = re.escape(rest[0])
            return re.search(rf"^\s*(?:def|class)\s+{name}\b|^{name}\s*[:=]",
                             source.read_text(encoding="utf-8"), re.M) is not None
    return False


def table_overrides(text: str) -> list[str]:
    """`key=VALUE` entries in the first column of the markdown tables of `text` (escaped `\\|` kept as
    `|`)."""
    entries = []
    for line in prose(text).splitlines():
        if not line.lstrip().startswith("|"):
            continue
        cells = re.split(r"(?<!\\)\|", line.strip())
        first = cells[1].strip() if len(cells) > 2 else ""
        m = re.fullmatch(r"`([^`]+)`", first)
        if m and "=" in m.group(1):
            entries.append(m.group(1).replace("\\|", "|"))
    return entries


def prose_overrides(text: str, top_keys: set[str]) -> list[str]:
    """Backticked `key=VALUE` spans in the prose whose first part is a top-level config key or group, and the
    overrides of every `trainer.train` command in the code blocks (`data.path=data/demo packing=unpacked`).

    Example: prose_overrides("set `train.compile=true`, not `a=b`", {"train"}) -> ["train.compile=true"].
    """
    def wanted(word: str) -> bool:
        key = word.partition("=")[0]
        return "=" in word and not word.startswith(("-", "+", "~")) and key.split(".")[0] in top_keys

    spans = [s.replace("\\|", "|") for s in INLINE_CODE.findall(prose(text))]
    entries = [s for s in spans if " " not in s and wanted(s)]
    for line in code_blocks(text).splitlines():
        if "trainer.train" not in line:
            continue
        try:
            words = shlex.split(line.split(" #")[0])
        except ValueError:
            words = line.split()
        entries += [w for w in words if wanted(w)]
    return entries


def readme_overrides(text: str) -> list[str]:
    """The entries of the README's override table (the table under its "overrides" heading)."""
    section = re.search(r"^##[^\n]*overrides[^\n]*\n(.*?)(?=^## |\Z)", text, re.S | re.M | re.I)
    return table_overrides(section.group(1)) if section else []


def config_has_key(container: dict, key: str) -> bool:
    node = container
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def unknown_overrides(entries: list[str], container: dict, config_dir: Path = CONFIG_DIR) -> list[str]:
    """Entries whose key is no config key, or whose config group or option file does not exist.

    `model=tiny|small` (or a sweep's `model=tiny,small`) names the group configs/model/ and its files
    tiny.yaml and small.yaml; `train.seq_len=T`
    must be a key of the composed config (null-valued keys count). Upper-case values (N, DIR, PATH) are
    placeholders, as are values of dotted keys, which are not checked.
    """
    unknown = []
    for entry in entries:
        key, _, value = entry.partition("=")
        if "." not in key and (config_dir / key).is_dir():
            options = [v for v in re.split(r"[|,]", value) if v and not re.fullmatch(r"[A-Z_]+", v)]
            if any(not (config_dir / key / f"{v}.yaml").exists() for v in options):
                unknown.append(entry)
        elif not config_has_key(container, key):
            unknown.append(entry)
    return unknown


def pages_not_linked(readme: str, pages: list[Path]) -> list[str]:
    """docs pages the README does not link to."""
    targets = {t.partition("#")[0] for t in LINK.findall(prose(readme))}
    return [f"docs/{p.name}" for p in pages if f"docs/{p.name}" not in targets]


@pytest.fixture(scope="module")
def composed_config() -> dict:
    """The config of a plain `python -m trainer.train`, hydra section included, as plain containers."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True)
    return OmegaConf.to_container(cfg, resolve=False)


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_there_are_docs_pages():
    assert len(DOC_PAGES) >= 5, DOC_PAGES


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_links_resolve(page):
    assert broken_links(page.read_text(encoding="utf-8"), page.parent) == []


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_named_paths_exist(page):
    assert missing_paths(page.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_table_overrides_are_config_keys(page, composed_config):
    assert unknown_overrides(table_overrides(page.read_text(encoding="utf-8")), composed_config) == []


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_overrides_in_prose_and_commands_are_config_keys(page, composed_config):
    top_keys = set(composed_config) | {d.name for d in CONFIG_DIR.iterdir() if d.is_dir()}
    entries = prose_overrides(page.read_text(encoding="utf-8"), top_keys)
    assert unknown_overrides(entries, composed_config) == []


def test_readme_override_table(composed_config):
    entries = readme_overrides(README.read_text(encoding="utf-8"))
    assert len(entries) >= 10, entries
    assert unknown_overrides(entries, composed_config) == []


def test_readme_is_short():
    assert len(README.read_text(encoding="utf-8")) <= README_MAX_CHARS


def test_readme_links_every_docs_page():
    assert pages_not_linked(README.read_text(encoding="utf-8"), DOC_PAGES) == []


# Each checker must be able to fail.

def test_broken_links_reports_a_missing_file_and_anchor(tmp_path):
    (tmp_path / "page.md").write_text("# A heading: `x`\n")
    text = ("[ok](page.md) [ok](page.md#a-heading-x) ![img](missing.png) [bad](page.md#nope) "
            "[web](https://example.org/x) [mail](mailto:a@b.c) [here](#top)\n\n# Top\n\n"
            "```\n[code](nope.md)\n```\n")
    assert broken_links(text, tmp_path) == ["missing.png", "page.md#nope"]


def test_missing_paths_reports_moved_modules_and_files():
    text = ("The loop was `trainer/loop.py`; now `trainer/run/loop.py`. Globs pass: "
            "`trainer/data/{reader,stream}.py`, `runs/<time>/x`. `trainer.run.loop.Trainer` exists, "
            "`trainer.checkpoint.no_such_name` does not.\n"
            "```bash\npython bench/packing.py && python bench/nope.py\npython -m trainer.nope\n```\n")
    assert missing_paths(text) == ["trainer/loop.py", "bench/nope.py", "trainer.nope",
                                   "trainer.checkpoint.no_such_name"]


def test_table_overrides_reads_first_column_only():
    text = ("| override | meaning |\n| --- | --- |\n| `model=tiny\\|small` | size |\n"
            "| `loss` | not an override |\n| plain=text | no backticks |\n")
    assert table_overrides(text) == ["model=tiny|small"]


def test_unknown_overrides_reports_bad_keys_groups_and_options(composed_config):
    entries = ["train.seq_len=T", "data.path=DIR", "seed=N", "hydra.run.dir=DIR", "model=tiny|gpt2-124m",
               "train.no_such_key=N", "model=tiny|huge", "nosuchgroup=x"]
    assert unknown_overrides(entries, composed_config) == ["train.no_such_key=N", "model=tiny|huge",
                                                           "nosuchgroup=x"]


def test_prose_overrides_finds_inline_and_command_overrides(composed_config):
    text = ("Set `train.compile=true` or `train.no_such=1`; `a=b` and `model.safetensors` "
            "are not overrides.\n"
            "```bash\npython -m trainer.train -m packing=packed,nope \"train.init_from='<ckpt>'\"  # x=1\n"
            "pip install a=1\n```\n")
    entries = prose_overrides(text, set(composed_config))
    assert entries == ["train.compile=true", "train.no_such=1", "packing=packed,nope",
                       "train.init_from='<ckpt>'"]  # the shell's quotes removed, Hydra's kept
    assert unknown_overrides(entries, composed_config) == ["train.no_such=1", "packing=packed,nope"]


def test_readme_overrides_finds_the_table():
    text = ("## Quickstart\n| `a.b=N` | x |\n## The overrides\n| override | meaning |\n|---|---|\n"
            "| `c.d=N` | y |\n## Next\n")
    assert readme_overrides(text) == ["c.d=N"]


def test_pages_not_linked_reports_a_missing_link():
    pages = [ROOT / "docs" / "a.md", ROOT / "docs" / "b.md"]
    assert pages_not_linked("[A](docs/a.md#top)", pages) == ["docs/b.md"]


def test_slug_matches_github():
    assert slug("The report: `python -m trainer.report RUN_OR_SWEEP_DIR... [--out DIR]`") == (
        "the-report-python--m-trainerreport-run_or_sweep_dir---out-dir")
    assert slug("Fine-tuning on chat data: `make sft`") == "fine-tuning-on-chat-data-make-sft"
