"""`python -m trainer.prepare`: documents -> tokenizer -> shards -> manifest, and its error handling."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import webdataset as wds

from tests.harness import require_module
from trainer.data.prepare.assemble import length_stats
from trainer.data.prepare.corpus import (
    ErrorPolicy,
    PrepareError,
    sanitize_key,
    split_module,
    stdlib_files,
    unique_keys,
    whole_modules,
)
from trainer.data.shards import TEXT_FIELD, load_manifest, shard_paths, write_shards
from trainer.data.tokenizer import (
    EOS_TOKEN,
    IM_END,
    IM_START,
    PAD_TOKEN,
    load_tokenizer,
    special_ids,
    tokenizer_hash,
    train_tokenizer,
)
from trainer.prepare import main, prepare

VOCAB = 300  # the smallest useful size (256 bytes + 4 special + a few merges): training takes milliseconds

TEXTS = {
    "a.txt": "def add(a, b):\n    return a + b\n",
    "b.txt": "Grüße aus Köln — naïve café, 日本語のテキスト, emoji 🎉🚀\n",
    "sub/c.md": "# Title\n\nSome *markdown* with\ttabs and  double  spaces.\r\nA CRLF line.\r\n",
    "sub/deeper/d.txt": "x = [i ** 2 for i in range(10)]\n" * 20,
    "e.txt": "short",
    "f.txt": "class Foo:\n    '''A docstring.'''\n    pass\n",
}


def write_files(root: Path, files: dict[str, str | bytes]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return root


def read_back(data_dir: Path, split: str) -> list[tuple[str, str]]:
    """(key, text) of every sample in a split, read with webdataset itself."""
    dataset = wds.WebDataset(shard_paths(data_dir, split), shardshuffle=False)
    return [(s["__key__"], s[TEXT_FIELD].decode("utf-8")) for s in dataset]


@pytest.fixture(scope="module")
def text_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(source dir, prepared dir) for TEXTS, with 2 documents per shard so there are several shards."""
    src = write_files(tmp_path_factory.mktemp("src"), TEXTS)
    out = tmp_path_factory.mktemp("out")
    prepare(f"text:{src}/**/*", out, vocab_size=VOCAB, docs_per_shard=2, val_fraction=0.2)
    return src, out


# ---------------------------------------------------------------------------------------------
# The demo corpus
# ---------------------------------------------------------------------------------------------

MODULE = '''\
"""Module docstring."""
import os

X = 1


@decorator
@other.decorator(arg=1)
def first(a):
    return a
\x0c
Y = 2  # top-level code after the first def belongs to no document


async def second():
    pass


@dataclass
class Third:
    """A class."""

    def method(self):
        return 3
'''


def test_split_module_cuts_header_functions_and_classes_with_decorators():
    docs = split_module(MODULE, "pkg.mod")
    assert [key for key, _ in docs] == ["pkg__mod", "pkg__mod--first", "pkg__mod--second", "pkg__mod--Third"]
    texts = dict(docs)
    assert texts["pkg__mod"] == '"""Module docstring."""\nimport os\n\nX = 1\n\n\n'
    assert texts["pkg__mod--first"] == "@decorator\n@other.decorator(arg=1)\ndef first(a):\n    return a\n"
    assert texts["pkg__mod--second"] == "async def second():\n    pass\n"
    assert texts["pkg__mod--Third"].startswith("@dataclass\nclass Third:\n")
    assert texts["pkg__mod--Third"].endswith("        return 3\n")
    for text in texts.values():
        ast.parse(text)  # every document is whole, valid Python


def test_split_module_without_header_or_defs():
    assert split_module("def f():\n    pass\n", "m") == [("m--f", "def f():\n    pass\n")]
    assert split_module("A = 1\n", "m") == [("m", "A = 1\n")]
    assert split_module("", "m") == []
    with pytest.raises(SyntaxError):
        split_module("def broken(:\n", "m")


def test_keys_are_webdataset_safe_and_unique():
    assert sanitize_key("json.decoder:JSONDecoder") == "json__decoder--JSONDecoder"
    assert sanitize_key("notes/day 1.txt") == "notes__day_1__txt"
    docs = [("k", "1"), ("k", "2"), ("j", "3"), ("k", "4")]
    assert [key for key, _ in unique_keys(docs)] == ["k", "k-2", "j", "k-3"]


def test_demo_dataset(demo_data: Path):
    """The real demo source (a small subset of this machine's standard library)."""
    manifest = load_manifest(demo_data)
    samples = read_back(demo_data, "train") + read_back(demo_data, "val")
    keys = [key for key, _ in samples]
    assert len(keys) == len(set(keys)) == 1000
    assert all("." not in key for key in keys)
    assert len(manifest["splits"]["train"]["shards"]) >= 4
    assert manifest["splits"]["val"]["docs"] >= 1
    for _, text in samples:
        ast.parse(text)
    lengths = manifest["splits"]["train"]["lengths"]
    assert lengths["max"] > 10 * lengths["median"]  # heavy-tailed, as real code is


def test_demo_modules_are_whole_modules_tokenized_with_the_demo_tokenizer(demo_data: Path, tmp_path, capsys):
    """`--source demo-modules --tokenizer <demo>/tokenizer` (the first 40 modules here): each document is one
    standard-library file, byte for byte, keyed by its module; far longer documents than the demo's."""
    out = tmp_path / "modules"
    assert main(["--source", "demo-modules", "--out", str(out), "--tokenizer", str(demo_data / "tokenizer"),
                 "--max-docs", "40", "--docs-per-shard", "10", "--val-fraction", "0.1",
                 "--workers", "1"]) == 0
    assert capsys.readouterr().out.startswith(f"prepared demo-modules -> {out}")
    manifest, demo = load_manifest(out), load_manifest(demo_data)
    assert (manifest["tokenizer"]["sha256"] == demo["tokenizer"]["sha256"]
            and not manifest["tokenizer"]["trained"])
    first = dict(whole_modules()[:40])
    samples = read_back(out, "train") + read_back(out, "val")
    assert sorted(key for key, _ in samples) == sorted(first)
    for key, text in samples:
        assert text == first[key].read_bytes().decode("utf-8"), key
    assert len(manifest["splits"]["train"]["shards"]) >= 3
    # Whole modules against functions and classes: a median 5x longer at least (in tokens, EOS included).
    assert manifest["splits"]["train"]["lengths"]["median"] > 5 * demo["splits"]["train"]["lengths"]["median"]


def test_whole_modules_leave_out_only_blank_or_undecodable_files():
    root, files = stdlib_files()
    kept = {path for _, path in whole_modules()}

    def usable(path: Path) -> bool:
        try:
            return bool(path.read_text(encoding="utf-8").strip())
        except UnicodeDecodeError:
            return False

    assert kept == {path for path in files if usable(path)}
    assert dict(whole_modules())["json__decoder"] == root / "json" / "decoder.py"


# ---------------------------------------------------------------------------------------------
# Round trip and manifest
# ---------------------------------------------------------------------------------------------


def test_round_trip_text_source(text_data):
    src, out = text_data
    samples = read_back(out, "train") + read_back(out, "val")
    keys = [key for key, _ in samples]
    assert len(keys) == len(set(keys)) == len(TEXTS)
    expected = {sanitize_key(rel): (src / rel).read_bytes().decode("utf-8") for rel in TEXTS}
    assert dict(samples) == expected
    assert "sub__deeper__d__txt" in expected  # key = path relative to the glob's fixed directory


def test_manifest_counts_match_the_shards(text_data):
    _, out = text_data
    manifest = load_manifest(out)
    tok = load_tokenizer(out / manifest["tokenizer"]["path"])
    for split, entry in manifest["splits"].items():
        paths = shard_paths(out, split)
        assert [Path(p).name for p in paths] == [s["name"] for s in entry["shards"]]
        all_counts = []
        for path, shard in zip(paths, entry["shards"], strict=True):
            texts = [s[TEXT_FIELD].decode() for s in wds.WebDataset([path], shardshuffle=False)]
            counts = [len(tok.encode(t).ids) + 1 for t in texts]  # + 1: the EOS the stream appends
            assert shard["docs"] == len(texts) <= 2
            assert shard["tokens"] == sum(counts)
            assert shard["bytes"] == os.path.getsize(path)
            all_counts += counts
        assert entry["docs"] == len(all_counts)
        assert entry["tokens"] == sum(all_counts)
        assert entry["lengths"] == length_stats(all_counts)
    assert manifest["splits"]["val"]["docs"] >= 1
    assert sorted(p.name for p in out.glob("*.tar")) == sorted(
        s["name"] for e in manifest["splits"].values() for s in e["shards"]
    )
    assert manifest["tokenizer"]["sha256"] == tokenizer_hash(out / "tokenizer")


def test_length_stats_worked_example():
    stats = length_stats([2, 4, 600])
    assert (stats["min"], stats["max"], stats["mean"], stats["median"]) == (2, 600, 202.0, 4.0)
    assert stats["p90"] == pytest.approx(480.8)
    assert (stats["count_gt_512"], stats["count_gt_2048"]) == (1, 0)
    assert stats["histogram"] == {"edges": [2**i for i in range(11)],
                                  "counts": [0, 1, 1, 0, 0, 0, 0, 0, 0, 1]}


def write_jsonl_texts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(n)))
    return path


def test_split_is_a_hash_of_the_key_and_gives_val_at_least_one_doc(tmp_path):
    """Val holds exactly the keys whose sha256 score is below val_fraction (an independent recomputation
    here); with too few documents for that, the lowest-scoring key moves to val, and train always keeps
    one."""
    import hashlib

    def score(key: str, seed: int) -> float:
        return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big") / 2**64

    src = write_jsonl_texts(tmp_path / "many.jsonl", 400)
    keys = [f"many--{i}" for i in range(1, 401)]
    prepare(f"jsonl:{src}", tmp_path / "a", vocab_size=VOCAB, val_fraction=0.1, seed=1)
    val = {key for key, _ in read_back(tmp_path / "a", "val")}
    assert val == {k for k in keys if score(k, 1) < 0.1} and 20 < len(val) < 70
    assert {key for key, _ in read_back(tmp_path / "a", "train")} == set(keys) - val

    few = write_jsonl_texts(tmp_path / "few.jsonl", 3)
    few_keys = [f"few--{i}" for i in range(1, 4)]
    assert not any(score(k, 0) < 0.01 for k in few_keys)  # the hash alone would give val nothing
    manifest = prepare(f"jsonl:{few}", tmp_path / "b", vocab_size=VOCAB, val_fraction=0.01, seed=0)
    assert [k for k, _ in read_back(tmp_path / "b", "val")] == [min(few_keys, key=lambda k: score(k, 0))]
    assert (manifest["splits"]["train"]["docs"], manifest["splits"]["val"]["docs"]) == (2, 1)
    assert prepare(f"jsonl:{few}", tmp_path / "c", vocab_size=VOCAB,
                   val_fraction=0.0)["splits"]["val"]["docs"] == 0
    one = write_jsonl_texts(tmp_path / "one.jsonl", 1)
    manifest = prepare(f"jsonl:{one}", tmp_path / "d", vocab_size=VOCAB, val_fraction=0.5)
    assert (manifest["splits"]["train"]["docs"], manifest["splits"]["val"]["docs"]) == (1, 0)


def test_rerun_with_fewer_docs_removes_stale_shards(tmp_path):
    src = write_files(tmp_path / "src", TEXTS)
    out = tmp_path / "out"
    prepare(f"text:{src}/**/*", out, vocab_size=VOCAB, docs_per_shard=1)
    assert len(list(out.glob("train-*.tar"))) == len(TEXTS) - 1
    prepare(f"text:{src}/*.txt", out, vocab_size=VOCAB, docs_per_shard=1)
    manifest = load_manifest(out)
    assert len(list(out.glob("*.tar"))) == 4 == sum(e["docs"] for e in manifest["splits"].values())


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def test_tokenizer_loads_in_transformers_with_matching_special_ids(text_data):
    transformers = require_module("transformers", "pip install -e '.[dev]'")
    _, out = text_data
    manifest = load_manifest(out)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(out / "tokenizer"))
    ids = manifest["tokenizer"]["special_ids"]
    assert hf.eos_token == EOS_TOKEN and hf.eos_token_id == ids["eos"]
    assert hf.pad_token == PAD_TOKEN and hf.pad_token_id == ids["pad"]
    assert hf.convert_tokens_to_ids([IM_START, IM_END]) == [ids["im_start"], ids["im_end"]]
    assert len(hf) == manifest["tokenizer"]["vocab_size"]
    chat = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                  add_generation_prompt=True)
    assert chat == f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n"
    tok = load_tokenizer(out / "tokenizer")
    assert hf("def f(): pass")["input_ids"] == tok.encode("def f(): pass").ids  # HF adds nothing either


def test_byte_level_round_trip_and_no_eos_added():
    tok = train_tokenizer(list(TEXTS.values()) * 5, vocab_size=VOCAB)
    assert special_ids(tok) == special_ids(tok).__class__(eos=0, pad=1, im_start=2, im_end=3)
    for text in [*TEXTS.values(), "  leading spaces", "Ωμέγα ∑ \x00 \u2028 tab\tend", "never seen: ЖЩЮ 𝔘𝔫𝔦"]:
        ids = tok.encode(text).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert special_ids(tok).eos not in ids  # the stream appends EOS; the tokenizer never does
    batch = tok.encode_batch(["a b", "ü"])
    assert [tok.decode(e.ids) for e in batch] == ["a b", "ü"]
    assert tok.get_vocab_size() <= VOCAB


def test_reusing_a_tokenizer_keeps_its_hash(text_data, tmp_path):
    src, out = text_data
    first_hash = load_manifest(out)["tokenizer"]["sha256"]
    out2 = tmp_path / "out2"
    manifest = prepare(f"text:{src}/*.txt", out2, tokenizer=str(out / "tokenizer"), vocab_size=999)
    assert manifest["tokenizer"]["sha256"] == first_hash == tokenizer_hash(out2 / "tokenizer")
    assert manifest["tokenizer"]["trained"] is False
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out2 / "tokenizer" / name).read_bytes() == (out / "tokenizer" / name).read_bytes()


def test_tokenizer_errors(tmp_path):
    with pytest.raises(PrepareError, match="no tokenizer at"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(PrepareError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(PrepareError, match="vocab size"):
        train_tokenizer(["abc"], vocab_size=100)


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the file, or a counted skip
# ---------------------------------------------------------------------------------------------

GOOD_LINE = json.dumps({"id": "good", "text": "fine text"}) + "\n"
BAD_JSONL = {  # case -> (bytes of the bad line, reason counted under --on-error skip, words in the error)
    "invalid_json": (b'{"text": "unterminated\n', "invalid_json", "invalid JSON"),
    "missing_text": (b'{"body": "wrong field"}\n', "missing_text", "no 'text' field"),
    "not_utf8": (b'{"text": "caf\xe9"}\n', "not_utf8", "not valid UTF-8"),
    "empty": (b'{"text": "  \\n\\t "}\n', "empty", "empty"),
    "not_object": (b'["a list"]\n', "invalid_json", "expected a JSON object"),
}
BAD_TEXT = {  # case -> (file content, or None for a dangling symlink; reason; words in the error)
    "not_utf8": (b"caf\xe9 au lait", "not_utf8", "not valid UTF-8"),
    "empty": (b" \n\t\n", "empty", "empty"),
    "unreadable": (None, "unreadable", "cannot read"),
}


def make_bad_jsonl(tmp_path: Path, case: str) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_bytes(GOOD_LINE.encode() + b"\n" + BAD_JSONL[case][0]
                     + GOOD_LINE.replace("good", "good2").encode())
    return path  # the bad line is line 3 (line 2 is blank, which is allowed)


def make_bad_text(tmp_path: Path, case: str) -> Path:
    src = write_files(tmp_path / "src", {"ok1.txt": "one", "ok2.txt": "two"})
    content = BAD_TEXT[case][0]
    if content is None:
        (src / "bad.txt").symlink_to(src / "missing-target.txt")
    else:
        (src / "bad.txt").write_bytes(content)
    return src


@pytest.mark.parametrize("case", sorted(BAD_JSONL))
def test_bad_jsonl_line_is_a_clear_error(tmp_path, case, capsys):
    path = make_bad_jsonl(tmp_path, case)
    assert main(["--source", f"jsonl:{path}", "--out", str(tmp_path / "out"),
                 "--vocab-size", str(VOCAB)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}:3: ")
    assert BAD_JSONL[case][2] in err
    assert "Traceback" not in err
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("case", sorted(BAD_JSONL))
def test_bad_jsonl_line_is_skipped_and_counted(tmp_path, case, capsys):
    path = make_bad_jsonl(tmp_path, case)
    manifest = prepare(f"jsonl:{path}", tmp_path / "out", vocab_size=VOCAB, on_error="skip")
    assert manifest["skipped"] == {BAD_JSONL[case][1]: 1}
    assert sorted(key for key, _ in read_back(tmp_path / "out", "train")
                  + read_back(tmp_path / "out", "val")) == [
        "data--1", "data--4"
    ]
    assert f"warning: skipping {path}:3" in capsys.readouterr().err


@pytest.mark.parametrize("case", sorted(BAD_TEXT))
def test_bad_text_file_is_a_clear_error_or_a_counted_skip(tmp_path, case, capsys):
    src = make_bad_text(tmp_path, case)
    source = f"text:{src}/*.txt"
    assert main(["--source", source, "--out", str(tmp_path / "out"), "--vocab-size", str(VOCAB)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {src / 'bad.txt'}: ") and BAD_TEXT[case][2] in err
    manifest = prepare(source, tmp_path / "out", vocab_size=VOCAB, on_error="skip")
    assert manifest["skipped"] == {BAD_TEXT[case][1]: 1}
    assert manifest["splits"]["train"]["docs"] + manifest["splits"]["val"]["docs"] == 2


@pytest.mark.parametrize("kind", ["text", "jsonl"])
def test_symlink_loops_and_aliases_read_each_real_file_once(tmp_path, kind):
    """`glob.glob("**")` follows `sub/up -> ..` round the loop until the path is too long: the same file read
    41 times (two loops: exponentially many). Each real file is read once, under its first path in sorted
    order; the other paths to it are counted as skipped (same_file), never silently read again."""
    src = tmp_path / "src"
    ext = "txt" if kind == "text" else "jsonl"
    for i in range(3):
        (src / "sub").mkdir(parents=True, exist_ok=True)
        body = f"document {i} body" if kind == "text" else json.dumps({"text": f"document {i} body"}) + "\n"
        (src / ("sub" if i == 2 else ".") / f"d{i}.{ext}").write_text(body)
    (src / "sub" / "up").symlink_to("..")  # a loop
    (src / "sub" / "again").symlink_to(".")  # a second loop: 2^depth paths to glob.glob
    (src / f"alias.{ext}").symlink_to(f"d0.{ext}")  # a second name for one file
    pattern = f"{src}/**/*.{ext}"
    manifest = prepare(f"{kind}:{pattern}", tmp_path / "out", vocab_size=VOCAB, val_fraction=0.0)
    texts = sorted(text for _, text in read_back(tmp_path / "out", "train"))
    assert texts == ["document 0 body", "document 1 body", "document 2 body"]
    # alias; the loops reach no file a second time as a listing
    assert manifest["skipped"] == {"same_file": 1}
    assert manifest["splits"]["train"]["docs"] == 3


def test_match_files_keeps_the_first_path_of_each_real_file(tmp_path):
    from trainer.data.prepare.corpus import match_files

    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("a")
    (d / ".hidden.txt").write_text("h")
    (d / "sub" / "b.txt").write_text("b")
    (d / "sub" / "up").symlink_to("..")
    (d / "z.txt").symlink_to("a.txt")
    (d / "dangling.txt").symlink_to("nowhere.txt")
    paths, aliases = match_files(f"{d}/**/*.txt")
    assert paths == [f"{d}/a.txt", f"{d}/dangling.txt", f"{d}/sub/b.txt"]
    assert aliases == {f"{d}/a.txt": 1, f"{d}/dangling.txt": 0, f"{d}/sub/b.txt": 0}
    assert match_files(f"{d}/*.txt")[0] == [f"{d}/a.txt", f"{d}/dangling.txt"]
    assert match_files(f"{d}/.*.txt")[0] == [f"{d}/.hidden.txt"]
    assert match_files(f"{d}/**/b.txt")[0] == [f"{d}/sub/b.txt"]
    assert match_files(f"{d}/*/b.txt")[0] == [f"{d}/sub/b.txt"]
    assert match_files(f"{d}/**")[0] == [f"{d}/a.txt", f"{d}/dangling.txt", f"{d}/sub/b.txt"]


@pytest.mark.parametrize("kind", ["jsonl", "text"])
def test_a_document_over_max_doc_mb_is_an_error_naming_it_or_a_counted_skip(tmp_path, kind, capsys):
    """One 52 MB JSON line made prepare peak at 10.6 GB (a document is tokenized whole). A document over
    --max-doc-mb (default 8) is an error naming it and its size, or under --on-error skip a counted skip
    (too_large), before it is tokenized; a text file is judged by its size before it is read."""
    big, small = "word " * 6000, "a short document"  # 30,000 bytes and 16
    if kind == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in (small, big, small + " again")))
        source, where = f"jsonl:{path}", f"{path}:2"
    else:
        src = write_files(tmp_path / "src", {"a.txt": small, "b.txt": big, "c.txt": small + " again"})
        source, where = f"text:{src}/*.txt", str(src / "b.txt")
    argv = ["--source", source, "--out", str(tmp_path / "out"), "--vocab-size", str(VOCAB),
            "--max-doc-mb", "0.02"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {where}: the document is 30,000 bytes, over --max-doc-mb 0.02 (tokenizing one "
                   "document takes ~200x its size in memory): split it, raise --max-doc-mb, or skip such "
                   "documents with --on-error skip\n")
    manifest = prepare(source, tmp_path / "out", vocab_size=VOCAB, on_error="skip", max_doc_mb=0.02,
                       val_fraction=0.0)
    assert manifest["skipped"] == {"too_large": 1} and manifest["splits"]["train"]["docs"] == 2
    assert manifest["options"]["max_doc_bytes"] == int(0.02 * 2**20)
    assert prepare(source, tmp_path / "all", vocab_size=VOCAB,
                   val_fraction=0.0)["splits"]["train"]["docs"] == 3
    assert main([*argv[:-1], "nan"]) == 2 and "--max-doc-mb must be a finite number > 0, got nan" in \
        capsys.readouterr().err


def test_jsonl_keys_from_file_stem_and_line_number(tmp_path):
    """Keys come from the position (stem + line), never from a field: unique by construction, nothing to
    remember. A second file with the same stem gets `-2` and its documents count as renamed."""
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "no body"}\n{"id": "x.1", "body": "custom key"}\n\n'
                    '{"id": "x.1", "body": "dup"}\n')
    (tmp_path / "c.json").write_text('{"body": "same stem"}\n')
    manifest = prepare(f"jsonl:{tmp_path}/c.*", tmp_path / "out", vocab_size=VOCAB, text_key="body",
                       val_fraction=0.0, on_error="skip")
    assert manifest["skipped"] == {"missing_text": 1}  # line 1 has no "body"
    assert manifest["renamed_duplicate_keys"] == 2  # the documents of c.jsonl, whose stem c.json had first
    assert sorted(read_back(tmp_path / "out", "train")) == [("c--1", "same stem"), ("c-2--2", "custom key"),
                                                             ("c-2--4", "dup")]


def test_user_mistakes_exit_2_without_traceback(tmp_path, capsys):
    out = str(tmp_path / "out")
    cases = {
        "no files match": ["--source", f"text:{tmp_path}/nothing/*.txt"],
        "unknown source": ["--source", "csv:x.csv"],
        "absent.jsonl": ["--source", f"jsonl:{tmp_path / 'absent.jsonl'}"],
        "no tokenizer at": ["--source", "demo", "--tokenizer", str(tmp_path / "none")],
        "val fraction": ["--source", "demo", "--val-fraction", "1.5"],
    }
    for words, argv in cases.items():
        assert main([*argv, "--out", out]) == 2, words
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and "Traceback" not in err


def test_main_prints_a_report(text_data, tmp_path, capsys):
    src, _ = text_data
    assert main(["--source", f"text:{src}/*.txt", "--out", str(tmp_path / "o"),
                 "--vocab-size", str(VOCAB)]) == 0
    report = capsys.readouterr().out
    for words in ("train:", "tokens", "p99", "skipped: none", "tokenizer:", "sha256"):
        assert words in report


def test_manifest_and_shard_errors_name_the_file(tmp_path):
    with pytest.raises(PrepareError, match="manifest.json: no manifest"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("[1, 2")
    with pytest.raises(PrepareError, match="manifest.json: cannot read"):
        load_manifest(tmp_path)


# ---------------------------------------------------------------------------------------------
# Atomic writing
# ---------------------------------------------------------------------------------------------


def test_write_shards_leaves_no_temp_file_when_interrupted(tmp_path):
    def samples():
        for i in range(3):
            yield f"k{i}", f"text {i}"
        raise RuntimeError("source failed mid-shard")

    with pytest.raises(RuntimeError):
        write_shards(samples(), tmp_path, "train", docs_per_shard=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train-000000.tar"]  # complete shards only
    assert [s["__key__"]
            for s in wds.WebDataset([str(tmp_path / "train-000000.tar")], shardshuffle=False)] == [
        "k0", "k1"
    ]


def test_write_shards_rejects_unsafe_keys(tmp_path):
    with pytest.raises(PrepareError, match="no dot"):
        write_shards([("a.b", "t")], tmp_path, "train", docs_per_shard=2)
    with pytest.raises(PrepareError, match="duplicate"):
        write_shards([("a", "t"), ("a", "u")], tmp_path, "train", docs_per_shard=2)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_prepare_leaves_no_temp_files(text_data):
    _, out = text_data
    leftovers = [p for p in out.rglob("*") if p.name.startswith(".") or p.name.endswith(".tmp")]
    assert leftovers == []


def test_error_policy_counts_skips():
    messages: list[str] = []
    policy = ErrorPolicy("skip", warn=messages.append)
    policy.bad("empty", "a.txt", "document is empty")
    policy.bad("empty", "b.txt", "document is empty")
    assert policy.skipped == {"empty": 2}
    assert messages[0] == "warning: skipping a.txt: document is empty"
    with pytest.raises(PrepareError, match="^a.txt: boom$"):
        ErrorPolicy("raise").bad("x", "a.txt", "boom")


def test_shards_are_the_bytes_webdatasets_tar_writer_writes(tmp_path):
    """Shards are written with tarfile alone (prepare must not import webdataset, which imports torch); the
    bytes are those of webdataset's own writer, so any webdataset reads them as before."""
    import io

    docs = [("k1", "short"), ("a" * 150, "a key longer than USTAR's 100 characters"),
            ("ü-key", "Grüße 🎉" * 300)]
    write_shards(docs, tmp_path, "train", docs_per_shard=10)
    expected = io.BytesIO()
    with wds.TarWriter(expected, encoder=False, mtime=0, format="PAX_FORMAT") as writer:
        for key, text in docs:
            writer.write({"__key__": key, TEXT_FIELD: text.encode("utf-8")})
    assert (tmp_path / "train-000000.tar").read_bytes() == expected.getvalue()


def test_prepare_and_its_workers_do_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, trainer.prepare; "
            "print(sorted(m for m in ('torch', 'webdataset') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"  # ~200 MB and 1.5 s less per worker process


def test_a_source_glob_never_reads_prepared_data(tmp_path):
    """`text:notes/**/*` with --out notes/prepared: the second run's glob matches the first run's shards,
    manifest and tokenizer, which it used to read as documents. Refused, naming the file; so is another
    dataset's."""
    notes = tmp_path / "notes"
    notes.mkdir()
    for i in range(30):
        (notes / f"n{i}.txt").write_text(f"note number {i}: " + "some words of text " * 20)
    source = f"text:{notes}/**/*"
    assert prepare(source, notes / "prepared", vocab_size=300,
                   val_fraction=0.0)["splits"]["train"]["docs"] == 30
    with pytest.raises(PrepareError, match=r"the source matches .*/notes/prepared/.*, inside --out"):
        prepare(source, notes / "prepared", vocab_size=300, val_fraction=0.0)
    with pytest.raises(PrepareError,
                       match=r"the source matches .*/notes/prepared/.*, inside a prepared dataset"):
        prepare(source, tmp_path / "other", vocab_size=300, val_fraction=0.0)
    assert not (tmp_path / "other").exists()
