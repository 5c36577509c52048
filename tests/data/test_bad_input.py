"""Bad input found by the data layer: each a clear error naming the file, sample or key and what to do.

Through the real `python -m trainer.train` these errors are checked in tests/test_errors.py;
here each is checked on the function that finds it.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from trainer.data.batch import Document, TokenIdError, check_token_ids, collate_rows
from trainer.data.loader import DocumentLoader
from trainer.data.reader import DataStreamError
from trainer.data.stream import DocumentStream
from trainer.data.tokenizer import PrepareError, load_tokenizer, special_ids
from trainer.errors import UserError
from trainer.prepare import main as prepare_main
from trainer.prepare import prepare

PAD = 1


# ---------------------------------------------------------------------------------------------
# Tar members that are not samples
# ---------------------------------------------------------------------------------------------


def write_tar(path: Path, members: list[tuple[str, bytes | str | None]]) -> Path:
    """A tar of (name, content): bytes -> a regular file, str -> a symlink to that name, None -> a
    directory."""
    with tarfile.open(path, "w") as tar:
        for name, content in members:
            info = tarfile.TarInfo(name)
            if isinstance(content, bytes):
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
            elif isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
                tar.addfile(info)
            else:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
    return path


@pytest.fixture
def odd_shard(tmp_path) -> Path:
    """Samples a, b, c where b's text is a symlink, plus a directory and a file without an extension."""
    return write_tar(tmp_path / "odd.tar", [
        ("a.txt", b"first document"),
        ("extra", None),
        ("b.txt", "a.txt"),
        ("README", b"not a sample: no key.field name"),
        ("c.txt", b"third document"),
    ])


def stream_over(shard: Path, demo_data: Path, **kwargs) -> DocumentStream:
    tok = load_tokenizer(demo_data / "tokenizer")
    return DocumentStream([str(shard)], demo_data / "tokenizer", special_ids(tok).eos, shuffle_buffer=1,
                          epochs=1, **kwargs)


def test_webdataset_skips_members_that_are_not_regular_file_samples(odd_shard, demo_data):
    """What webdataset does: a directory, a symlink and a name without an extension are dropped without a
    word. So a symlink in place of a sample loses that sample, and only the manifest's count can notice."""
    docs = list(DocumentLoader(stream_over(odd_shard, demo_data)))
    assert [d.key for d in docs] == ["a", "c"]


def test_a_sample_lost_to_a_non_file_member_is_an_error_naming_the_shard(odd_shard, demo_data):
    stream = stream_over(odd_shard, demo_data, expected_docs={"odd.tar": 3})
    with pytest.raises(DataStreamError, match=r"odd\.tar: read 2 samples but the manifest lists 3; it holds "
                       r"members that are not samples, which webdataset skips: .*'b\.txt' \(a symlink\)"):
        list(DocumentLoader(stream))


def test_a_sample_lost_to_a_non_file_member_is_counted_under_skip(odd_shard, demo_data):
    loader = DocumentLoader(stream_over(odd_shard, demo_data, expected_docs={"odd.tar": 3}, on_error="skip"))
    assert [d.key for d in loader] == ["a", "c"]
    assert loader.skipped() == {"truncated_shard": 1}


def test_a_sample_over_data_max_doc_mb_is_an_error_naming_it_or_a_counted_skip(tmp_path, demo_data):
    """A 200 MB member aborted the tokenizer (a document is tokenized whole, ~200x its size): a sample over
    data.max_doc_mb is an error naming shard, key and size before it is decoded, or under skip a counted
    skip."""
    from trainer.data.config import DataConfig

    big = b"word " * 6000  # 30,000 bytes
    shard = write_tar(tmp_path / "big.tar", [("a.txt", b"first document"), ("b.txt", big),
                                             ("c.txt", b"third")])
    limit = DataConfig(max_doc_mb=0.02).max_doc_bytes
    with pytest.raises(DataStreamError) as e:
        list(DocumentLoader(stream_over(shard, demo_data, max_doc_bytes=limit)))
    assert str(e.value) == (f"{shard}: sample 'b' is 30,000 bytes of text, over data.max_doc_mb=0.02 "
                            "(tokenizing one document takes ~200x its size in memory): raise "
                            "data.max_doc_mb, or skip such documents with data.on_error=skip")
    loader = DocumentLoader(stream_over(shard, demo_data, max_doc_bytes=limit, on_error="skip"))
    assert [d.key for d in loader] == ["a", "c"] and loader.skipped() == {"too_large": 1}
    assert [d.key for d in DocumentLoader(stream_over(shard, demo_data,
                                                      max_doc_bytes=DataConfig().max_doc_bytes))] \
        == ["a", "b", "c"]  # the default bound: 8 MB
    with pytest.raises(ValueError, match="data.max_doc_mb must be a finite number > 0, got nan"):
        DataConfig(max_doc_mb=float("nan"))


# ---------------------------------------------------------------------------------------------
# Documents whose text is not a string (trainer.prepare --source jsonl:...)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, kind", [(42, "a number (42)"), (["a", "b"], 'an array (["a", "b"])'),
                                         (None, "null")])
def test_jsonl_text_that_is_not_a_string_names_file_line_and_field(tmp_path, capsys, value, kind):
    path = tmp_path / "corpus.jsonl"
    lines = [{"id": "one", "body": "fine text"}, {"id": "two", "body": value},
             {"id": "three", "body": "more text"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["--source", f"jsonl:{path}", "--out", str(tmp_path / "out"), "--vocab-size", "300",
            "--text-key", "body"]
    assert prepare_main(args) == 2
    err = capsys.readouterr().err
    assert (err.startswith(f"error: {path}:2: field 'body' is {kind}, not a string")
            and "--on-error skip" in err)
    assert "Traceback" not in err and err.count("\n") == 1

    manifest = prepare(f"jsonl:{path}", tmp_path / "out", vocab_size=300, text_key="body", on_error="skip")
    assert manifest["skipped"] == {"text_not_string": 1}
    assert manifest["splits"]["train"]["docs"] + manifest["splits"]["val"]["docs"] == 2
    assert f"warning: skipping {path}:2: field 'body' is {kind}" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# A tokenizer without the four special tokens
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def tokenizer_without_specials(demo_data, tmp_path) -> Path:
    """The demo tokenizer with <|pad|> and <|im_end|> removed (ids and added tokens alike)."""
    spec = json.loads((demo_data / "tokenizer" / "tokenizer.json").read_text())
    drop = {"<|pad|>", "<|im_end|>"}
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in drop]
    spec["model"]["vocab"] = {t: i for t, i in spec["model"]["vocab"].items() if t not in drop}
    out = tmp_path / "tok"
    out.mkdir()
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


def test_special_ids_names_the_missing_tokens_and_the_file(tokenizer_without_specials):
    tok = Tokenizer.from_file(str(tokenizer_without_specials / "tokenizer.json"))
    with pytest.raises(PrepareError) as caught:  # was: TypeError: list() takes no keyword arguments
        special_ids(tok, tokenizer_without_specials)
    message = str(caught.value)
    assert message.startswith(f"{tokenizer_without_specials / 'tokenizer.json'}: tokenizer lacks the special "
                              "tokens ['<|pad|>', '<|im_end|>']")
    assert "trainer.prepare" in message and isinstance(caught.value, UserError)
    with pytest.raises(PrepareError, match=r"^tokenizer lacks the special tokens"):
        special_ids(tok)


def test_prepare_refuses_a_tokenizer_without_the_special_tokens(tokenizer_without_specials, tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("some text")
    args = ["--source", f"text:{src}", "--out", str(tmp_path / "out"), "--tokenizer",
            str(tokenizer_without_specials)]
    assert prepare_main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tokenizer_without_specials / 'tokenizer.json'}: tokenizer lacks the "
                          "special tokens")


# ---------------------------------------------------------------------------------------------
# Token ids the model has no embedding for
# ---------------------------------------------------------------------------------------------


def doc(key: str, *ids: int) -> Document:
    return Document(key, np.array(ids, dtype=np.int64))


def test_check_token_ids_passes_ids_inside_the_vocabulary():
    batch = collate_rows([[doc("a", 5, 6, 0), doc("b", 7, 0)], [doc("c", 9, 0)]], 6, PAD, "packed")
    check_token_ids(batch, vocab_size=10)


def test_check_token_ids_names_documents_id_vocab_size_and_what_to_do():
    # Row 0: a(3) b(2) + 1 padding; row 1: c(4) + 2 padding; row 2: d(2) + 4 padding. b and d hold ids >= 512.
    rows = [[doc("a", 5, 6, 0), doc("b", 7, 600)], [doc("c", 9, 9, 9, 0)], [doc("d", 700, 0)]]
    for layout in ("packed", "unpacked"):
        batch = collate_rows(rows if layout == "packed" else [[d] for row in rows for d in row], 6, PAD,
                             layout)
        with pytest.raises(TokenIdError) as caught:
            check_token_ids(batch, vocab_size=512)
        message = str(caught.value)
        assert ("token id 700 is outside the model's vocabulary (vocab_size 512) in document(s) 'b', 'd'"
                in message)
        assert "another tokenizer than the one the model was built for" in message
        assert ("python -m trainer.prepare --tokenizer" in message
                and "raise model.vocab_size to at least 701" in message)
        assert isinstance(caught.value, UserError)


def test_check_token_ids_rejects_negative_ids():
    batch = collate_rows([[doc("neg", 5, -3, 0)]], 4, PAD, "packed")
    with pytest.raises(TokenIdError, match=r"token id -3 .* in document\(s\) 'neg'") as caught:
        check_token_ids(batch, vocab_size=10)
    assert "raise model.vocab_size" not in str(caught.value)


def test_check_token_ids_names_rows_when_documents_cannot_be_told_from_padding():
    """A one-token chunk ending its row looks like padding; then the error names the row instead of
    guessing."""
    batch = collate_rows([[doc("x", 5, 6), doc("tail", 1)], [doc("y", 99, 0)]], 3, PAD, "packed")
    with pytest.raises(TokenIdError, match=r"token id 99 .* in rows 1 "):
        check_token_ids(batch, vocab_size=10)


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_record_files_that_hold_no_record_are_refused_and_nothing_is_written(tmp_path, kind):
    """A parquet of 0 rows, an empty gzip: their bytes (the format's header) hold no document. Refused at the
    merge naming the source, with no dataset written (no manifest.json, no shards)."""
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "empty.parquet"
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    else:
        import gzip

        path = tmp_path / "empty.jsonl.gz"
        gzip.open(path, "wb").close()
    with pytest.raises(PrepareError, match=rf"no documents in '{kind}:.*{path.name}': its files hold none"):
        prepare(f"{kind}:{path}", tmp_path / "out", vocab_size=300, val_fraction=0.0)
    assert not (tmp_path / "out" / "manifest.json").exists() and not list((tmp_path / "out").glob("*.tar"))
