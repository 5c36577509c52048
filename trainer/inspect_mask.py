"""The packing figure as a tool: which positions of one packed row may attend to which, and what each
predicts.

    python -m trainer.inspect_mask --lengths 3,2,5,2                      # synthetic documents a, b, c, d
    python -m trainer.inspect_mask --text "def f():|return 1|x = 2"       # real tokens, the run's tokenizer
    python -m trainer.inspect_mask --lengths 3,2,5,2 --row-len 14 --out /tmp/insp   # 2 padding positions
    python -m trainer.inspect_mask --tree "4:2,3,1;2:1,1"                # two multiple-choice items as trees

Writes mask.png (two panels: isolated documents vs one causal mask per row) and mask.html (a self-contained
page: both matrices, tokens, positions, labels, cu_seqlens; hovering a token highlights what it may read and
shows the target it predicts). Nothing here builds a mask or a label itself: the row comes from
`trainer.data.batch.collate_rows` and both matrices from `trainer.model.attention.block_diagonal_mask`, the
same code the training run uses.

Worked example, the seed's --lengths 3,2,5,2 (T = 12):

    tokens       = [a0 a1 a2 | b0 b1 | c0 c1 c2 c3 c4 | d0 d1]
    position_ids = [ 0  1  2 |  0  1 |  0  1  2  3  4 |  0  1]      (continuous: 0 .. 11)
    labels       = [-100 a1 a2 | -100 b1 | -100 c1 c2 c3 c4 | -100 d1]
    cu_seqlens   = [0, 3, 5, 10, 12] (int32)   max_seqlen = 5
    b1 (t = 4) may read b0 b1 when isolated, a0 .. b1 under one causal mask; it predicts nothing
    (labels[5] = -100: c0 starts a new document). a1 (t = 1) predicts a2.

--tree "4:2,3,1" shows the scoring layout `tree` (trainer.data.batch.collate_trees, the mask of
trainer.model.attention.TreeSegments): a query q0..q3 computed once, then choices a, b, c as branches, each
reading the query and itself (left panel) instead of the choices before it (right: one causal mask per tree, a
leak); positions continue from the query's end in every branch, and q3 predicts a0, b0 and c0.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import string
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.data.batch import IGNORE_INDEX, Batch, Document, Tree, collate_rows, collate_trees
from trainer.errors import UserError, command
from trainer.model.attention import TreeSegments, block_diagonal_mask, document_ids
from trainer.outputs import check_not_inside_input

DEFAULT_TOKENIZER = "data/demo/tokenizer"
DEFAULT_OUT = "mask_inspector"
MAX_ROW_LEN = 256  # the page draws 2 * T^2 cells; beyond this the browser, not the reader, is the bottleneck
VISIBLE_WHITESPACE = str.maketrans({" ": "␣", "\n": "↵", "\t": "⇥"})


class InspectError(UserError, ValueError):
    """Bad input to the inspector; the message is what the command line prints."""


@dataclass
class DocumentSet:
    """Documents to pack into one row, with the pad id and a way to show any id as a short string."""

    docs: list[Document]
    """Tokenized documents, EOS included (for text), in row order."""
    pad_id: int
    """Fills the row's tail when row_len exceeds the documents' total."""
    token_str: Callable[[int], str]
    """id -> what the page shows for it."""


# ---------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------


def parse_lengths(text: str) -> list[int]:
    """'3,2,5,2' -> [3, 2, 5, 2], with an error that says what was wrong."""
    pieces = [p.strip() for p in text.split(",")]
    if not text.strip():
        raise InspectError("--lengths is empty: give document lengths like 3,2,5,2")
    if not all(p.isdigit() for p in pieces):
        raise InspectError(f"--lengths {text!r}: expected comma-separated integers like 3,2,5,2")
    lengths = [int(p) for p in pieces]
    if min(lengths) < 1:
        raise InspectError(f"--lengths {text!r}: every document needs at least one token")
    return lengths


def doc_name(k: int) -> str:
    """Document k's letter: 0 -> 'a', 25 -> 'z', then 'd26', 'd27', ..."""
    return string.ascii_lowercase[k] if k < 26 else f"d{k}"


def synthetic_documents(lengths: Sequence[int]) -> DocumentSet:
    """Documents of the given lengths with readable tokens; id 0 is padding, the rest count up from 1.

    Example: [3, 2] -> tokens a0 a1 a2 | b0 b1 with ids [1 2 3 | 4 5]; token_str(0) == '<pad>'.
    """
    names = ["<pad>"] + [f"{doc_name(k)}{j}" for k, n in enumerate(lengths) for j in range(n)]
    docs, next_id = [], 1
    for k, n in enumerate(lengths):
        docs.append(Document(key=doc_name(k), tokens=np.arange(next_id, next_id + n, dtype=np.int64)))
        next_id += n
    return DocumentSet(docs=docs, pad_id=0, token_str=names.__getitem__)


def text_documents(text: str, tokenizer_dir: str | Path, sep: str = "|") -> DocumentSet:
    """Split `text` on `sep` and tokenize each piece as the training stream does: the run's tokenizer, no
    added special tokens, framed as the tokenizer frames a document (SpecialIds.frame: one EOS appended, and a
    BOS first where the tokenizer starts documents with one).

    Example: "ab|c" -> two documents, encode("ab") + [eos] and encode("c") + [eos] ([bos] + encode("ab") +
    [eos] with a Llama-3 tokenizer). Pieces are kept verbatim (spaces around `sep` are part of the documents).
    """
    from trainer.data.tokenizer import load_tokenizer, special_ids

    if not sep:
        raise InspectError("--sep is empty: give the text that separates the documents of --text "
                           "(default: |)")
    pieces = text.split(sep)
    empty = [i for i, p in enumerate(pieces) if not p]
    if empty:
        raise InspectError(f"--text: piece {empty[0]} (0-based, split on {sep!r}) is empty")
    tok = load_tokenizer(tokenizer_dir)
    ids = special_ids(tok, tokenizer_dir)
    docs = []
    for k, enc in enumerate(tok.encode_batch(pieces, add_special_tokens=False)):
        docs.append(Document(key=doc_name(k), tokens=np.array(ids.frame(enc.ids), dtype=np.int32)))

    def token_str(i: int) -> str:
        shown = tok.decode([i], skip_special_tokens=False)
        # A byte-level token that is part of a multi-byte character decodes to U+FFFD: show its BPE symbol.
        return (tok.id_to_token(i) if "\ufffd" in shown else shown).translate(VISIBLE_WHITESPACE)

    return DocumentSet(docs=docs, pad_id=ids.pad, token_str=token_str)


# ---------------------------------------------------------------------------------------------------
# The row and its matrices
# ---------------------------------------------------------------------------------------------------


def collate_one_row(doc_set: DocumentSet, row_len: int | None, reset_positions: bool) -> Batch:
    """The packed (1, row_len) batch of `doc_set`, from the training collator itself."""
    total = sum(len(d) for d in doc_set.docs)
    row_len = total if row_len is None else row_len
    if row_len < total:
        raise InspectError(f"--row-len {row_len} is shorter than the {total} tokens of the documents")
    if row_len > MAX_ROW_LEN:
        raise InspectError(f"row of {row_len} tokens: the inspector draws at most {MAX_ROW_LEN}")
    return collate_rows([doc_set.docs], row_len, doc_set.pad_id, "packed", reset_positions=reset_positions)


def predicted_targets(labels: Sequence[int]) -> list[int | None]:
    """The target each position predicts under the loss's internal shift: labels[t + 1], or None.

    Example: labels [-100 a1 a2 -100 b1] -> [a1 a2 None b1 None] (t = 2 would predict b0, masked;
    the last position has no t + 1).
    """
    shifted = list(labels[1:]) + [IGNORE_INDEX]
    return [None if y == IGNORE_INDEX else int(y) for y in shifted]


def inspect_row(doc_set: DocumentSet, row_len: int | None = None) -> dict:
    """Everything the page shows for one packed row, as plain lists (JSON-ready).

    Example, synthetic_documents([3, 2, 5, 2]), row_len 14: tokens end in '<pad> <pad>', labels in
    [-100 -100], position_ids_reset = [0 1 2 0 1 0 1 2 3 4 0 1 0 1], cu_seqlens = [0 3 5 10 12 14],
    max_seqlen = 5, mask_isolated = block_diagonal_mask(cu_seqlens=...), mask_causal = the same builder
    over one segment [0, 14] (what SDPA's is_causal does for isolate_documents=False).
    """
    reset = collate_one_row(doc_set, row_len, reset_positions=True)
    continuous = collate_one_row(doc_set, row_len, reset_positions=False)
    T = reset.input_ids.shape[1]
    whole_row = torch.tensor([0, T], dtype=torch.int32)
    input_ids = reset.input_ids[0].tolist()
    labels = reset.labels[0].tolist()
    return {
        "tokens": [doc_set.token_str(i) for i in input_ids],
        "input_ids": input_ids,
        "position_ids_reset": reset.position_ids[0].tolist(),
        "position_ids_continuous": continuous.position_ids[0].tolist(),
        "labels": labels,
        "targets": predicted_targets(labels),
        "cu_seqlens": reset.cu_seqlens.tolist(),
        "max_seqlen": reset.max_seqlen,
        "segment_ids": document_ids(reset.cu_seqlens, T).tolist(),
        "num_docs": reset.num_docs,
        "num_tokens": reset.num_tokens,
        "mask_isolated": block_diagonal_mask(cu_seqlens=reset.cu_seqlens).int().tolist(),
        "mask_causal": block_diagonal_mask(cu_seqlens=whole_row).int().tolist(),
    }


def parse_trees(text: str) -> list[tuple[int, list[int]]]:
    """'4:2,3,1;2:1,1' -> [(4, [2, 3, 1]), (2, [1, 1])]: trees of a query length and its choices' lengths."""
    out = []
    for piece in text.split(";"):
        query, _, choices = piece.strip().partition(":")
        if not query.strip().isdigit() or not choices:
            raise InspectError(f"--tree {text!r}: expected QUERY:CHOICE,CHOICE,... per tree (';' between "
                               "trees), like 4:2,3,1")
        out.append((int(query), parse_lengths(choices)))
        if out[-1][0] < 1:
            raise InspectError(f"--tree {text!r}: every query needs at least one token")
    return out


def inspect_trees(spec: Sequence[tuple[int, Sequence[int]]], row_len: int | None = None) -> dict:
    """What the page shows for one row of trees (the `tree` scoring layout), from collate_trees and
    TreeSegments. Tree k's query tokens are named q{k}_j (q_j for a single tree), its choices' tokens by
    letter: a0 a1, b0, ... The left panel is the tree mask; the right one the same trees as one causal
    document each (the leak the branch condition prevents). `predicts` lists, per position, the positions
    whose tokens its logits score."""
    names, trees, next_id = ["<pad>"], [], 1
    for k, (query, choices) in enumerate(spec):
        tag = "" if len(spec) == 1 else str(k)
        names += [f"q{tag}_{j}" if tag else f"q{j}" for j in range(query)]
        trunk = np.arange(next_id, next_id + query, dtype=np.int64)
        next_id += query
        branches = []
        for c, n in enumerate(choices):
            names += [f"{doc_name(c)}{tag}_{j}" if tag else f"{doc_name(c)}{j}" for j in range(n)]
            branches.append(np.arange(next_id, next_id + n, dtype=np.int64))
            next_id += n
        trees.append(Tree(key=str(k), trunk=trunk, branches=tuple(branches)))
    total = sum(len(t) for t in trees)
    row_len = total if row_len is None else row_len
    if row_len < total or row_len > MAX_ROW_LEN:
        raise InspectError(f"--row-len {row_len}: the trees hold {total} tokens and the inspector draws at "
                           f"most {MAX_ROW_LEN}")
    batch = collate_trees([trees], row_len, 0)
    tree_mask = TreeSegments(batch.cu_seqlens, batch.max_seqlen, batch.branches.reshape(-1)).dense_mask(
        torch.device("cpu"))
    input_ids, predictors = batch.input_ids[0].tolist(), batch.predictors[0].tolist()
    predicts = [[p for p, source in enumerate(predictors) if source == t] for t in range(row_len)]
    return {
        "tokens": [names[i] for i in input_ids],
        "input_ids": input_ids,
        "position_ids_reset": batch.position_ids[0].tolist(),
        "position_ids_continuous": list(range(row_len)),
        "labels": batch.labels[0].tolist(),
        "targets": [input_ids[p[0]] if p else None for p in predicts],
        "predicts": predicts,
        "branches": batch.branches[0].tolist(),
        "cu_seqlens": batch.cu_seqlens.tolist(),
        "max_seqlen": batch.max_seqlen,
        "segment_ids": document_ids(batch.cu_seqlens, row_len).tolist(),
        "num_docs": batch.num_docs,
        "num_tokens": batch.num_tokens,
        "mask_isolated": tree_mask.int().tolist(),
        "mask_causal": block_diagonal_mask(cu_seqlens=batch.cu_seqlens).int().tolist(),
        "panels": ["tree: each choice reads the query and itself", "one causal mask per tree (choices leak)"],
    }


# ---------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------


def render_png(data: dict) -> bytes:
    """Both masks side by side as PNG bytes: tokens on both axes, document boundaries as red lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    T = len(data["tokens"])
    side = min(14.0, max(4.0, 0.32 * T + 1.5))  # inches per panel
    fig, axes = plt.subplots(1, 2, figsize=(2 * side, side + 0.8), constrained_layout=True)
    titles = data.get("panels") or ["isolated documents (block-diagonal causal)", "one causal mask per row"]
    panels = (("mask_isolated", titles[0]), ("mask_causal", titles[1]))
    for ax, (key, title) in zip(axes, panels, strict=True):
        ax.imshow(data[key], cmap=ListedColormap(["#eef1f5", "#2f6fb0"]), vmin=0, vmax=1,
                  interpolation="nearest")
        _draw_axes(ax, data, title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def _draw_axes(ax, data: dict, title: str) -> None:
    """Token tick labels (when they fit), a cell grid and the segment boundaries of cu_seqlens."""
    T = len(data["tokens"])
    ax.set_title(title)
    ax.set_xlabel("key (may be read)")
    ax.set_ylabel("query (reads)")
    if T <= 64:
        ax.set_xticks(range(T), data["tokens"], rotation=90, fontsize=8)
        ax.set_yticks(range(T), data["tokens"], fontsize=8)
    ax.set_xticks([t - 0.5 for t in range(1, T)], minor=True)
    ax.set_yticks([t - 0.5 for t in range(1, T)], minor=True)
    ax.grid(which="minor", color="white", linewidth=0.5)
    ax.tick_params(which="minor", length=0)
    for b in data["cu_seqlens"][1:-1]:
        ax.axhline(b - 0.5, color="#d0342c", linewidth=1.5)
        ax.axvline(b - 0.5, color="#d0342c", linewidth=1.5)


def write_html(data: dict, path: str | Path, png: bytes | None = None) -> Path:
    """The self-contained page: data as JSON in <script id="inspector-data">, PNG as a data URI, no URLs."""
    png = render_png(data) if png is None else png
    # "<" escaped so no token can close the <script> element early; JSON.parse reads \u003c back.
    payload = json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")
    page = (
        _PAGE.replace("__SUMMARY__", f"{data['num_docs']} documents, {len(data['tokens'])} positions")
        .replace("__PNG__", base64.b64encode(png).decode("ascii"))
        .replace("__DATA__", payload)  # last: tokens are user text and may contain the other markers
    )
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path


PAGE_MARK = "<title>packtrain mask inspector</title>"
"""In every mask.html this command writes: one without it is someone else's, never overwritten."""


def check_out_dir(out_dir: Path) -> None:
    """--out never clobbers or confuses something else: not a prepared dataset, a run dir or a checkpoint, nor
    a directory anywhere inside one (RUN/checkpoints, RUN/.hydra, DATA/tokenizer), judged where a symlink
    leads; and no mask.html this command did not write."""
    check_not_inside_input(out_dir)
    page = out_dir / "mask.html"
    if page.is_file() and PAGE_MARK not in page.read_text(encoding="utf-8", errors="replace")[:4096]:
        raise InspectError(f"--out {out_dir} holds a mask.html that inspect_mask did not write: it would be "
                           "overwritten; give another directory")


def write_outputs(data: dict, out_dir: str | Path) -> tuple[Path, Path]:
    """mask.png and mask.html under `out_dir` (created); returns their paths."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = render_png(data)
    png_path = out_dir / "mask.png"
    png_path.write_bytes(png)
    return png_path, write_html(data, out_dir / "mask.html", png)


# ---------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.inspect_mask", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="documents separated by --sep, tokenized with the run's tokenizer + EOS")
    src.add_argument("--lengths", help="synthetic document lengths, e.g. 3,2,5,2")
    src.add_argument("--tree", help="the tree scoring layout: QUERY:CHOICE,CHOICE,... lengths per item, ';' "
                                    "between items, e.g. 4:2,3,1")
    p.add_argument("--sep", default="|", help="document separator for --text (default: |)")
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER,
                   help=f"tokenizer directory (default: {DEFAULT_TOKENIZER})")
    p.add_argument("--row-len", type=int, default=None, help="row length T (default: the documents' total)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT}/)")
    return p


@command(extra_user_errors=(OSError,))  # OSError: --out cannot be written
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tree is not None:
        paths = write_outputs(inspect_trees(parse_trees(args.tree), args.row_len), args.out)
        for path in paths:
            print(path)
        return 0
    if args.lengths is not None:
        doc_set = synthetic_documents(parse_lengths(args.lengths))
    else:
        doc_set = text_documents(args.text, args.tokenizer, args.sep)
    paths = write_outputs(inspect_row(doc_set, args.row_len), args.out)
    for path in paths:
        print(path)
    return 0


_PAGE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<link rel="icon" href="data:,">
<title>packtrain mask inspector</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #1d2330; }
  h1 { font-size: 1.3em; margin: 0 0 .2em; }
  h2 { font-size: 1.05em; margin: 1.4em 0 .4em; }
  code, td, th { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; }
  table { border-collapse: collapse; }
  #row th { text-align: right; padding: 2px 6px; color: #556; font-weight: normal; white-space: nowrap; }
  #row td { border: 1px solid #d5dae3; padding: 2px 5px; text-align: center; white-space: pre; }
  #row td.tok { cursor: pointer; background: #f7f9fc; }
  #row td.seg-start { border-left: 3px solid #d0342c; }
  #row td.pad { color: #98a; background: #f1f1f1; }
  #row td.ignore { color: #c0261d; font-weight: bold; background: #fdecea; }
  .grids { display: flex; gap: 2.5em; flex-wrap: wrap; align-items: flex-start; }
  .grid th { font-weight: normal; color: #445; padding: 0 4px; white-space: pre; }
  .grid thead th { writing-mode: vertical-rl; transform: rotate(180deg); text-align: left; padding: 4px 0; }
  .grid tbody th { text-align: right; cursor: pointer; }
  .grid td { width: 14px; height: 14px; padding: 0; border: 1px solid #fff; background: #eef1f5; }
  .grid td.on { background: #9dbbe0; }
  .grid td.seg-left { border-left: 2px solid #d0342c; }
  .grid td.seg-top { border-top: 2px solid #d0342c; }
  .grid td.attend { background: #1f5fa8; }
  .grid td.query-row:not(.on) { background: #dde3ec; }
  .query { outline: 2px solid #f0a020; background: #fff4d6 !important; }
  .target { outline: 2px solid #2a9d4b; background: #e3f6e8 !important; }
  #hover { margin: .8em 0; padding: .5em .8em; background: #f5f7fa; border-left: 4px solid #f0a020; min-height: 1.4em; }
  .legend span { display: inline-block; margin-right: 1.2em; }
  .sw { display: inline-block; width: 12px; height: 12px; vertical-align: middle; margin-right: 4px; }
  img { max-width: 100%; border: 1px solid #d5dae3; }
</style>
</head>
<body>
<h1>Mask inspector</h1>
<div>__SUMMARY__ &middot; <code id="cu"></code> &middot; <code id="maxlen"></code></div>

<h2>The packed row</h2>
<table id="row"></table>
<div id="hover">Hover a token (a row header of a matrix, or a token above) to see what it may attend to and what it predicts.</div>

<h2>Who may attend to whom</h2>
<div class="legend">
  <span><i class="sw" style="background:#9dbbe0"></i>allowed</span>
  <span><i class="sw" style="background:#1f5fa8"></i>allowed for the hovered token</span>
  <span><i class="sw" style="background:#eef1f5"></i>blocked</span>
  <span><i class="sw" style="background:#d0342c"></i>document boundary (cu_seqlens)</span>
</div>
<div class="grids">
  <div><h2 id="title-isolated">Isolated documents (block-diagonal causal)</h2><table class="grid" id="grid-isolated"></table></div>
  <div><h2 id="title-causal">One causal mask per row</h2><table class="grid" id="grid-causal"></table></div>
</div>

<h2>Figure (mask.png)</h2>
<img id="figure" alt="isolated vs one causal mask" src="data:image/png;base64,__PNG__">

<script type="application/json" id="inspector-data">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("inspector-data").textContent);
const T = D.tokens.length;
const starts = new Set(D.cu_seqlens.slice(0, -1));
const isPad = t => t >= D.num_tokens;
document.getElementById("cu").textContent = "cu_seqlens = [" + D.cu_seqlens.join(", ") + "] (int32)";
document.getElementById("maxlen").textContent = "max_seqlen = " + D.max_seqlen;

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

function buildRow() {
  const table = document.getElementById("row");
  const rows = [
    ["t", t => String(t)],
    ["token", t => D.tokens[t]],
    ["input_id", t => String(D.input_ids[t])],
    ["position (reset)", t => String(D.position_ids_reset[t])],
    ["position (continuous)", t => String(D.position_ids_continuous[t])],
    ["label", t => D.labels[t] === -100 ? "-100" : D.tokens[t]],
    ["predicts (label[t+1])", t => D.targets[t] === null ? "none" : D.tokens[t + 1]],
  ];
  for (const [name, cell] of rows) {
    const tr = el("tr");
    tr.appendChild(el("th", name));
    for (let t = 0; t < T; t++) {
      const td = el("td", cell(t));
      td.dataset.t = t;
      if (starts.has(t)) td.classList.add("seg-start");
      if (isPad(t)) td.classList.add("pad");
      if (name === "token") { td.classList.add("tok"); td.tabIndex = 0; }
      if (name === "label") { td.classList.add("label"); if (D.labels[t] === -100) td.classList.add("ignore"); }
      tr.appendChild(td);
    }
    table.appendChild(tr);
  }
}

function buildGrid(id, mask) {
  const table = document.getElementById(id);
  const head = el("thead"), hr = el("tr");
  hr.appendChild(el("th"));
  for (let k = 0; k < T; k++) hr.appendChild(el("th", D.tokens[k]));
  head.appendChild(hr);
  table.appendChild(head);
  const body = el("tbody");
  for (let q = 0; q < T; q++) {
    const tr = el("tr"), th = el("th", D.tokens[q], "qhead");
    th.dataset.t = q;
    th.tabIndex = 0;
    tr.appendChild(th);
    for (let k = 0; k < T; k++) {
      const td = el("td", undefined, mask[q][k] ? "on" : "off");
      td.dataset.q = q;
      td.dataset.k = k;
      td.title = D.tokens[q] + " -> " + D.tokens[k] + (mask[q][k] ? ": allowed" : ": blocked");
      if (starts.has(k) && k > 0) td.classList.add("seg-left");
      if (starts.has(q) && q > 0) td.classList.add("seg-top");
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
  table.appendChild(body);
}

function clearMarks() {
  for (const cls of ["attend", "query", "target", "query-row"]) {
    for (const e of document.querySelectorAll("." + cls)) e.classList.remove(cls);
  }
}

function predicted(t) {  // the positions whose tokens t's logits score (a tree's query end scores every choice's first)
  if (D.predicts) return D.predicts[t];
  return D.targets[t] === null ? [] : [t + 1];
}

function describe(t) {
  const n = D.mask_isolated[t].reduce((a, b) => a + b, 0);
  const m = D.mask_causal[t].reduce((a, b) => a + b, 0);
  const target = predicted(t).length ? predicted(t).map((i) => D.tokens[i]).join(", ") : "none";
  const box = document.getElementById("hover");
  box.textContent = "";
  box.append("t = " + t + " ", el("code", D.tokens[t]), " (segment " + D.segment_ids[t] + ", position " +
    D.position_ids_reset[t] + "): attends to " + n + " positions isolated, " + m +
    " under one causal mask; predicts ");
  const out = el("code", target);
  out.id = "hover-target";
  box.append(out);
}

function highlight(t) {
  clearMarks();
  for (const [id, mask] of [["grid-isolated", D.mask_isolated], ["grid-causal", D.mask_causal]]) {
    for (const td of document.querySelectorAll("#" + id + " td[data-q=\"" + t + "\"]")) {
      td.classList.add("query-row");
      if (mask[t][td.dataset.k]) td.classList.add("attend");
    }
    document.querySelector("#" + id + " th[data-t=\"" + t + "\"]").classList.add("query");
  }
  document.querySelector("#row td.tok[data-t=\"" + t + "\"]").classList.add("query");
  for (const i of predicted(t)) document.querySelector("#row td.tok[data-t=\"" + i + "\"]").classList.add("target");
  document.body.dataset.hovered = t;
  describe(t);
}

function onPoint(event) {
  const e = event.target.closest("[data-t]");
  if (e && e.matches("td.tok, th.qhead")) highlight(Number(e.dataset.t));
}

if (D.panels) {
  document.getElementById("title-isolated").textContent = D.panels[0];
  document.getElementById("title-causal").textContent = D.panels[1];
}
buildRow();
buildGrid("grid-isolated", D.mask_isolated);
buildGrid("grid-causal", D.mask_causal);
document.addEventListener("mouseover", onPoint);
document.addEventListener("focusin", onPoint);
</script>
</body>
</html>
"""  # noqa: E501 (the page is HTML, six of its lines are long)


if __name__ == "__main__":
    sys.exit(main())
