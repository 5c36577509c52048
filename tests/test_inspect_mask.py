"""The mask inspector shows exactly what the collator and the model's mask builder produce.

Oracles: `collate_rows` (ids, positions, labels, cu_seqlens) and `block_diagonal_mask` (both matrices), plus
the seed's hand-checked [3, 2, 5, 2] row. The browser tests load the written page in headless chromium
(tests/browser.py) and check what a reader sees: no console errors, the figure, and hover highlights.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.browser import console_errors, images_rendered
from trainer.data.batch import collate_rows
from trainer.data.stream import DocumentStream
from trainer.data.tokenizer import load_tokenizer, special_ids
from trainer.inspect_mask import (
    DocumentSet,
    inspect_row,
    inspect_trees,
    main,
    synthetic_documents,
    text_documents,
    write_outputs,
)
from trainer.model.attention import block_diagonal_mask

ROOT = Path(__file__).resolve().parents[1]
SEED_LENGTHS = [3, 2, 5, 2]
TEXT = 'def f():\n    return 1|x = "é</script>"|y'
DATA_KEYS = ("input_ids", "position_ids_reset", "position_ids_continuous", "labels", "cu_seqlens",
             "max_seqlen", "mask_isolated", "mask_causal")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 512-token BPE trained on 200 demo documents (~2 s)."""
    from trainer.prepare import prepare

    out = tmp_path_factory.mktemp("inspect_data")
    prepare("demo", out, vocab_size=512, max_docs=200, docs_per_shard=100)
    return out / "tokenizer"


def expected_data(doc_set: DocumentSet, row_len: int) -> dict:
    """The oracle: the training collator and the model's mask builder, called directly."""
    reset = collate_rows([doc_set.docs], row_len, doc_set.pad_id, "packed", reset_positions=True)
    continuous = collate_rows([doc_set.docs], row_len, doc_set.pad_id, "packed", reset_positions=False)
    return {
        "input_ids": reset.input_ids[0].tolist(),
        "position_ids_reset": reset.position_ids[0].tolist(),
        "position_ids_continuous": continuous.position_ids[0].tolist(),
        "labels": reset.labels[0].tolist(),
        "cu_seqlens": reset.cu_seqlens.tolist(),
        "max_seqlen": reset.max_seqlen,
        "mask_isolated": block_diagonal_mask(cu_seqlens=reset.cu_seqlens).int().tolist(),
        "mask_causal": torch.tril(torch.ones(row_len, row_len, dtype=torch.int64)).tolist(),
    }


def page_data(html_path: Path) -> dict:
    """The JSON the page embeds in <script type="application/json" id="inspector-data">."""
    match = re.search(r'<script type="application/json" id="inspector-data">(.*?)</script>',
                      html_path.read_text(encoding="utf-8"), re.S)
    assert match, "no inspector-data block in the page"
    return json.loads(match.group(1))


def assert_matches(data: dict, expected: dict) -> None:
    for key in DATA_KEYS:
        assert data[key] == expected[key], key


# ---------------------------------------------------------------------------------------------------
# Data equality with the collator and the mask builder
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("row_len", [12, 14])
def test_synthetic_row_matches_collator_and_mask_builder(row_len: int, tmp_path: Path) -> None:
    doc_set = synthetic_documents(SEED_LENGTHS)
    data = inspect_row(doc_set, row_len)
    assert_matches(data, expected_data(doc_set, row_len))
    _, html_path = write_outputs(data, tmp_path)
    assert page_data(html_path) == data


def test_text_row_matches_collator_and_stream_tokenization(tokenizer_dir: Path, tmp_path: Path) -> None:
    doc_set = text_documents(TEXT, tokenizer_dir)
    pieces = TEXT.split("|")
    eos = special_ids(load_tokenizer(tokenizer_dir)).eos
    stream = DocumentStream(["unused.tar"], tokenizer_dir, eos_id=eos)
    # (shard, sample, key, payload) as the reader draws
    items = [(0, n, key, None) for n, key in enumerate("abc")]
    for ours, theirs in zip(doc_set.docs, stream._documents(items, pieces, ["unused.tar"], None),
                            strict=True):
        assert ours.tokens.tolist() == theirs.tokens.tolist()  # EOS appended, no special tokens added
    total = sum(len(d) for d in doc_set.docs)
    for row_len in (total, total + 3):
        data = inspect_row(doc_set, row_len)
        assert_matches(data, expected_data(doc_set, row_len))
        assert data["tokens"][total - 1] == "<|endoftext|>"
        _, html_path = write_outputs(data, tmp_path / str(row_len))
        assert page_data(html_path) == data  # '</script>' in a token does not end the JSON early


def test_seed_example_by_hand() -> None:
    data = inspect_row(synthetic_documents(SEED_LENGTHS))
    tokens = "a0 a1 a2 b0 b1 c0 c1 c2 c3 c4 d0 d1".split()
    assert data["tokens"] == tokens
    shown_labels = [tokens[t] if y != -100 else -100 for t, y in enumerate(data["labels"])]
    assert shown_labels == [-100, "a1", "a2", -100, "b1", -100, "c1", "c2", "c3", "c4", -100, "d1"]
    assert data["position_ids_reset"] == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0, 1]
    assert data["position_ids_continuous"] == list(range(12))
    assert data["cu_seqlens"] == [0, 3, 5, 10, 12]
    assert data["max_seqlen"] == 5
    assert data["mask_isolated"][4] == [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]  # b1 reads b0, b1
    assert data["mask_causal"][4] == [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]  # ... or a0 .. b1
    predicts = [None if y is None else tokens[t + 1] for t, y in enumerate(data["targets"])]
    assert predicts == ["a1", "a2", None, "b1", None, "c1", "c2", "c3", "c4", None, "d1", None]


def test_a_tree_by_hand() -> None:
    """--tree 3:2,1 (issue 57): the query once, each choice reading it and itself, positions continuing from
    the query's end in each branch, q2 predicting both first tokens; the right panel is the leak (one causal
    mask)."""
    data = inspect_trees([(3, [2, 1])], row_len=8)
    assert data["tokens"] == ["q0", "q1", "q2", "a0", "a1", "b0", "<pad>", "<pad>"]
    assert data["position_ids_reset"] == [0, 1, 2, 3, 4, 3, 0, 1]
    assert data["branches"] == [0, 0, 0, 1, 1, 2, 0, 0]
    assert data["predicts"] == [[], [], [3, 5], [4], [], [], [], []]
    assert data["labels"] == [-100, -100, -100, 4, 5, 6, -100, -100]
    assert data["mask_isolated"][5] == [1, 1, 1, 0, 0, 1, 0, 0]  # b0 reads the query and itself, not a0 a1
    assert data["mask_causal"][5] == [1, 1, 1, 1, 1, 1, 0, 0]
    assert data["cu_seqlens"] == [0, 6, 8]


def test_padding_tail_is_its_own_segment() -> None:
    data = inspect_row(synthetic_documents(SEED_LENGTHS), row_len=14)
    assert data["tokens"][12:] == ["<pad>", "<pad>"]
    assert data["labels"][12:] == [-100, -100]
    assert data["position_ids_reset"][12:] == [0, 1]
    assert data["cu_seqlens"] == [0, 3, 5, 10, 12, 14]
    assert data["targets"][11:] == [None, None, None]
    assert all(row[12] == 0 for row in data["mask_isolated"][:12])  # no real token reads padding


# ---------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------


def test_cli_writes_both_files_and_prints_their_paths(tmp_path: Path) -> None:
    out = tmp_path / "insp"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.inspect_mask", "--lengths", "3,2,5,2", "--row-len", "14",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(out / "mask.png"), str(out / "mask.html")]
    assert (out / "mask.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(page_data(out / "mask.html")["tokens"]) == 14


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--lengths", "3,2,5,2", "--row-len", "10"], "--row-len 10 is shorter than the 12 tokens"),
        (["--text", "a|b", "--tokenizer", "{tmp}/no-such-tokenizer"], "{tmp}/no-such-tokenizer"),
        (["--lengths", ""], "--lengths is empty"),
        (["--lengths", "3,x"], "expected comma-separated integers"),
        (["--lengths", "3,0"], "at least one token"),
        (["--text", "a||b"], "piece 1"),
        (["--tree", "4-2,3"], "expected QUERY:CHOICE,CHOICE,..."),
        (["--tree", "4:2,0"], "at least one token"),
        (["--tree", "4:2", "--row-len", "5"], "the trees hold 6 tokens"),
    ],
)
def test_bad_input_is_one_clear_line(argv: list[str], says: str, tmp_path: Path, capsys) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main([*argv, "--out", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert says.replace("{tmp}", str(tmp_path)) in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------
# In a real browser
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seed_page(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    data = inspect_row(synthetic_documents(SEED_LENGTHS), row_len=14)
    _, html_path = write_outputs(data, tmp_path_factory.mktemp("seed_page"))
    return html_path, data


def hover(driver, selector: str) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    ActionChains(driver).move_to_element(driver.find_element(By.CSS_SELECTOR, selector)).perform()


def highlighted(driver, grid: str) -> list[tuple[int, int]]:
    """(query, key) of the cells carrying the hover highlight in one matrix."""
    cells = driver.execute_script(
        f"return Array.from(document.querySelectorAll('#{grid} td.attend')).map(c => [+c.dataset.q, "
        "+c.dataset.k]);"
    )
    return [tuple(c) for c in cells]


def test_page_loads_without_errors_and_renders_figure_and_grids(browser, seed_page) -> None:
    html_path, data = seed_page
    browser.get(html_path.as_uri())
    assert console_errors(browser) == []
    assert images_rendered(browser)
    for grid in ("grid-isolated", "grid-causal"):
        drawn = browser.execute_script(f"return document.querySelectorAll('#{grid} td.on').length;")
        assert drawn == sum(map(sum, data[grid.replace("grid-", "mask_")]))
    ignored = browser.execute_script(
        "return Array.from(document.querySelectorAll('#row td.label.ignore')).map(c => +c.dataset.t);"
    )
    assert ignored == [t for t, y in enumerate(data["labels"]) if y == -100]


@pytest.mark.parametrize(
    ("t", "selector", "predicts"),
    [
        (0, "#grid-isolated th.qhead[data-t='0']", "a1"),
        (2, "#row td.tok[data-t='2']", "none"),  # a2 would predict b0: a new document
        (4, "#grid-causal th.qhead[data-t='4']", "none"),
        (7, "#row td.tok[data-t='7']", "c3"),
        (10, "#grid-isolated th.qhead[data-t='10']", "d1"),
        (13, "#row td.tok[data-t='13']", "none"),  # padding
    ],
)
def test_hover_highlights_exactly_the_allowed_cells_and_the_target(browser, seed_page, t, selector,
                                                                   predicts) -> None:
    html_path, data = seed_page
    if browser.current_url != html_path.as_uri():
        browser.get(html_path.as_uri())
    hover(browser, selector)
    oracle = {"grid-isolated": block_diagonal_mask(cu_seqlens=torch.tensor(data["cu_seqlens"],
                                                                           dtype=torch.int32)),
              "grid-causal": block_diagonal_mask(cu_seqlens=torch.tensor([0, 14], dtype=torch.int32))}
    for grid, mask in oracle.items():
        assert highlighted(browser, grid) == [(t, k) for k in range(14) if mask[t, k]], grid
    shown = browser.execute_script("return document.getElementById('hover-target').textContent;")
    assert shown == predicts
    targets = browser.execute_script("return Array.from(document.querySelectorAll('#row .target'))"
                                     ".map(c => +c.dataset.t);")
    assert targets == ([] if predicts == "none" else [t + 1])
    assert console_errors(browser) == []


def test_a_tree_page_in_browser(browser, tmp_path: Path) -> None:
    """Hovering the query's last token marks every choice's first token as what it predicts; hovering a later
    choice's token lights the query and that choice only."""
    data = inspect_trees([(4, [2, 3, 1])])
    _, html_path = write_outputs(data, tmp_path)
    browser.get(html_path.as_uri())
    assert console_errors(browser) == []
    assert browser.execute_script("return document.getElementById('title-isolated').textContent;") == \
        data["panels"][0]
    hover(browser, "#row td.tok[data-t='3']")  # q3
    assert browser.execute_script("return document.getElementById('hover-target').textContent;") == \
        "a0, b0, c0"
    targets = browser.execute_script("return Array.from(document.querySelectorAll('#row .target'))"
                                     ".map(c => +c.dataset.t);")
    assert targets == [4, 6, 9]
    hover(browser, "#grid-isolated th.qhead[data-t='8']")  # b2
    assert highlighted(browser, "grid-isolated") == [(8, k) for k in (0, 1, 2, 3, 6, 7, 8)]
    assert console_errors(browser) == []


def test_text_page_in_browser(browser, tokenizer_dir: Path, tmp_path: Path) -> None:
    data = inspect_row(text_documents(TEXT, tokenizer_dir))
    _, html_path = write_outputs(data, tmp_path)
    browser.get(html_path.as_uri())
    assert console_errors(browser) == []
    assert images_rendered(browser)
    assert browser.execute_script("return JSON.parse(document.getElementById('inspector-data')"
                                  ".textContent);") == data
    last = len(data["tokens"]) - 1
    hover(browser, f"#grid-isolated th.qhead[data-t='{last}']")
    start = max(b for b in data["cu_seqlens"] if b <= last)
    assert highlighted(browser, "grid-isolated") == [(last, k) for k in range(start, last + 1)]
    assert browser.execute_script("return document.getElementById('hover-target').textContent;") == "none"


@pytest.mark.parametrize("inside", ["run/checkpoints", "run/.hydra", "data/tokenizer", "link", "link/deeper"])
def test_out_inside_a_run_a_dataset_or_through_a_link_to_one_is_refused(inside: str, tmp_path: Path) -> None:
    """Before: only --out naming the run dir or the dataset itself was refused; a directory inside one (a
    run's checkpoints/ or .hydra/, a dataset's tokenizer/), also reached through a symlink, got mask.png and
    mask.html."""
    from trainer.inspect_mask import inspect_row, synthetic_documents, write_outputs
    from trainer.outputs import OutputError

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / ".hydra").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "data" / "tokenizer").mkdir(parents=True)
    (tmp_path / "data" / "manifest.json").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "data" / "tokenizer")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    what = "a training run's dir" if inside.startswith("run") else "a prepared dataset"
    with pytest.raises(OutputError, match=rf"--out .*{inside}.* is inside .* which is {what}"):
        write_outputs(inspect_row(synthetic_documents([3, 2]), 8), tmp_path / inside)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
