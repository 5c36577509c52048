"""trainer.data.prepare: a document too large to tokenize in the memory this process may still allocate is one
line naming it, before the tokenizer sees it (issue 46: `prepare --max-doc-mb 100` on a 52 MB line under a
6 GB address-space cap ended in the tokenizer library's SIGABRT, no packtrain message). Here: a 24 MB line
under a 2.5 GB cap."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

from tests.helpers import ENV, ROOT, assert_one_error_line

CAP = int(2.5 * (1 << 30))


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))


def test_a_document_too_large_to_tokenize_in_the_memory_left_is_one_line(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    with corpus.open("w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n")
        f.write(json.dumps({"text": "a" * (24 << 20)}) + "\n")  # one 24 MB word: ~3 GB to tokenize
    proc = subprocess.run([sys.executable, "-m", "trainer.prepare", "--source", f"jsonl:{corpus}", "--out",
                           str(tmp_path / "data"), "--max-doc-mb", "100", "--vocab-size", "300"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600, preexec_fn=_capped)
    assert_one_error_line(proc.returncode, proc.stderr, "corpus", "the document is 25,165,8",
                          "tokenizing it needs ~3.0 GB", "more than the", "this process may still allocate")
    assert not (tmp_path / "data" / "manifest.json").exists()
