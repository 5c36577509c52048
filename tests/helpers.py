"""Helpers shared by the test modules: running the real commands, tiny models and batches, a shard server,
the package's import graph. Imported as `from tests.helpers import ...`; fixtures live in tests/conftest.py,
process harnesses (gloo ranks, free ports, optional modules) in tests/harness.py."""

from __future__ import annotations

import ast
import contextlib
import functools
import http.server
import json
import math
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.harness import free_port
from trainer.checkpoint.store import latest_checkpoint
from trainer.config import from_container
from trainer.data.batch import Document
from trainer.distributed.ddp import DDPEngine
from trainer.distributed.groups import DistInfo
from trainer.model import GPTConfig

# ---------------------------------------------------------------------------------------------------
# Running `python -m trainer.train` and friends as users do
# ---------------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
# model=tiny is the default (configs/config.yaml); not named, so a Hugging Face init_from gives the model
SMALL = [
    "train.seq_len=128",
    "train.tokens_per_step=1024",
    "train.micro_batch_tokens=512",
    "data.num_workers=1",
    "data.shuffle_buffer=64",
    "packing.buffer_size=64",
    "attention=sdpa_docs",
    "logging.progress=false",
    "logging.wandb.mode=disabled",
    "train.eval_every=10",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
"""The environment of a command run by a test: one thread per process, this checkout on the path, no W&B."""


# Runs each argv through trainer.train.cli() in ONE process (a start costs seconds); argv[1] is a JSON list of
# argv lists, argv[2] the path it writes [[exit status, stderr], ...] to (tests/test_errors.py and
# tests/test_bad_inputs.py).
TRAIN_CLI_DRIVER = r"""
import contextlib, io, json, sys
from trainer.train import cli
cases, out_path, results = json.loads(sys.argv[1]), sys.argv[2], []
for argv in cases:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        sys.argv = ["trainer.train", *argv]
        try:
            code = cli()
        except SystemExit as e:  # a user's mistake inside the Hydra job exits from there
            code = e.code
    results.append([code, err.getvalue()])
with open(out_path, "w") as f:
    json.dump(results, f)
"""


def run_train(run_dir: Path, data: Path | None, *overrides: str, launcher: list[str] | None = None,
              extra_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`python -m trainer.train` on `data` (data.path; None: the overrides name the data, e.g.
    data.sources)."""
    data_arg = [] if data is None else [f"data.path={data}"]
    cmd = (launcher or [sys.executable, "-m"]) + ["trainer.train", *data_arg, f"hydra.run.dir={run_dir}",
                                                  *SMALL, *overrides, *extra_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def torchrun(nproc: int = 2, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
            str(free_port()), *extra, "-m"]


def make_trainer(data: Path, run_dir: Path, *overrides: str):
    from trainer.run.loop import Trainer

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        composed = compose(config_name="config", overrides=[f"data.path={data}", *SMALL, "train.eval_every=0",
                                                           "train.checkpoint_every=0", *overrides])
    cfg = from_container(OmegaConf.to_container(composed, resolve=True), str(run_dir))
    return Trainer(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))


def assert_one_error_line(code: int, stderr: str, *phrases: str) -> str:
    """Exit status 2 and stderr holding exactly one line, `error: ...`, with every phrase in it."""
    assert code == 2, stderr
    assert "Traceback" not in stderr and "HYDRA_FULL_ERROR" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])
    return lines[0]


def run_sweep(sweep: Path, data: Path, *overrides: str) -> Path:
    """`python -m trainer.train -m ...` (the tiny settings of tests/test_train.py): one run dir per job,
    named by its job number."""
    cmd = [sys.executable, "-m", "trainer.train", "-m", f"data.path={data}", f"hydra.sweep.dir={sweep}",
           "hydra.sweep.subdir=${hydra.job.num}", *SMALL, "train.checkpoint_every=0", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return sweep


CHECKPOINT_SEQ_LEN = 128
"""Row length of `train_checkpoint`'s runs (and so of the session's `checkpoint` and `exported` fixtures)."""


def train_checkpoint(run_dir: Path, data: Path, *overrides: str) -> Path:
    """A tiny real checkpoint: 3 steps of `python -m trainer.train` (model=tiny, seq_len 128) on `data`."""
    run_train(run_dir, data, "train.max_steps=3", f"train.seq_len={CHECKPOINT_SEQ_LEN}", *overrides)
    return latest_checkpoint(run_dir)


def as_written_before_checksums(checkpoint: Path) -> Path:
    """`checkpoint` made as packtrain wrote them before it recorded checksums: no checksums.json, and no
    meta.json key saying one was written (with that key, a missing checksums.json is damage)."""
    import json

    from trainer.checkpoint import store

    (checkpoint / store.CHECKSUMS_FILE).unlink()
    meta = json.loads((checkpoint / store.META_FILE).read_text())
    meta.pop(store.CHECKSUMS_KEY, None)
    (checkpoint / store.META_FILE).write_text(json.dumps(meta, indent=2))
    return checkpoint


def run_export(checkpoint: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.export", str(checkpoint), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


# ---------------------------------------------------------------------------------------------------
# A tiny model and random documents for the step's objective (tests/run/test_step.py and others)
# ---------------------------------------------------------------------------------------------------

SEQ_LEN = 32
PAD = 1
MODEL = GPTConfig(vocab_size=61, n_layer=2, n_head=2, n_embd=32, max_seq_len=SEQ_LEN)


def make_steps(num_steps: int = 3, docs_per_step: int = 12, seed: int = 0) -> list[list[Document]]:
    """Random documents (lengths 2..SEQ_LEN, EOS = 0 last) grouped into logical batches."""
    rng = np.random.default_rng(seed)
    steps = []
    for s in range(num_steps):
        docs = []
        for d in range(docs_per_step):
            n = int(rng.integers(2, SEQ_LEN + 1))
            tokens = np.append(rng.integers(2, MODEL.vocab_size, size=n - 1), 0)
            docs.append(Document(key=f"s{s}d{d}", tokens=tokens))
        steps.append(docs)
    return steps


class GradientRecorder(DDPEngine):
    """The real DDP engine (one process) that also keeps the gradients it is about to apply: the step's
    gradient after every micro-batch, read before the optimizer changes anything."""

    def apply_gradients(self) -> None:
        self.grads = {name: p.grad.detach().clone() for name, p in self.module.named_parameters()}
        super().apply_gradients()


def assert_same_params(a: dict, b: dict, tol: float = 1e-5) -> None:
    for name in a:
        diff = (a[name] - b[name]).abs().max().item()
        assert diff <= tol, f"{name}: max abs diff {diff:.3g}"


def plain_document_loss(params: dict[str, torch.Tensor], cfg: GPTConfig, ids: torch.Tensor) -> torch.Tensor:
    """The summed next-token cross entropy of one document (token ids, learned positions from 0) through the
    GPT weights `params` (named as the model's), in plain PyTorch written here: no packing, no cu_seqlens, no
    trainer attention or loss code. A one-token document has no target: 0."""
    ids = torch.as_tensor(ids)
    n = len(ids)
    if n < 2:
        return torch.zeros(())
    heads, dim = cfg.n_head, cfg.n_embd // cfg.n_head
    p = params
    x = p["wte.weight"][ids] + p["wpe.weight"][:n]
    for i in range(cfg.n_layer):
        h = F.layer_norm(x, (cfg.n_embd,), p[f"blocks.{i}.ln_1.weight"], p[f"blocks.{i}.ln_1.bias"])
        qkv = h @ p[f"blocks.{i}.attn.c_attn.weight"].T + p[f"blocks.{i}.attn.c_attn.bias"]
        q, k, v = (t.view(n, heads, dim).transpose(0, 1) for t in qkv.split(cfg.n_embd, -1))
        scores = q @ k.transpose(1, 2) / math.sqrt(dim)
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, cfg.n_embd)
        x = x + y @ p[f"blocks.{i}.attn.c_proj.weight"].T + p[f"blocks.{i}.attn.c_proj.bias"]
        h = F.layer_norm(x, (cfg.n_embd,), p[f"blocks.{i}.ln_2.weight"], p[f"blocks.{i}.ln_2.bias"])
        h = F.gelu(h @ p[f"blocks.{i}.mlp.c_fc.weight"].T + p[f"blocks.{i}.mlp.c_fc.bias"],
                   approximate="tanh")
        x = x + h @ p[f"blocks.{i}.mlp.c_proj.weight"].T + p[f"blocks.{i}.mlp.c_proj.bias"]
    logits = F.layer_norm(x, (cfg.n_embd,), p["ln_f.weight"], p["ln_f.bias"]) @ p["wte.weight"].T
    return F.cross_entropy(logits[:-1], ids[1:], reduction="sum")


def split(steps, fractions: list[float]) -> list[list[list[Document]]]:
    """Per step, consecutive slices of its documents, one per rank, in the given proportions of docs."""
    out = []
    for docs in steps:
        cuts = np.cumsum([0] + [round(f * len(docs)) for f in fractions])
        cuts[-1] = len(docs)
        out.append([docs[cuts[r] : cuts[r + 1]] for r in range(len(fractions))])
    return out


# ---------------------------------------------------------------------------------------------------
# A corpus of short documents and one epoch of its chunks (the reshaped-resume tests)
# ---------------------------------------------------------------------------------------------------

SHORT_SHARD_SCALES = (2.0, 1.5, 1.0, 0.7, 0.5)
"""Document lengths of each shard of `short_docs_corpus`, relative: shards of very different token counts."""


def stdlib_words(*files: str) -> list[str]:
    """The words (runs of letters) of standard-library source files, in order: text that is on every
    machine."""
    import re
    import sysconfig

    std = Path(sysconfig.get_paths()["stdlib"])
    return [w for name in files for w in re.findall(r"[A-Za-z]+", (std / name).read_text())]


def short_docs_corpus(out: Path, docs_per_shard: int = 100) -> Path:
    """5 shards of `docs_per_shard` short documents (log-normal, ~10 to ~300 words; shard 0's twice shard 2's,
    shard 4's half), words taken from standard-library sources, prepared with a 300-token BPE: more documents
    per shard than a DataLoader chunk (64), so readers stop inside shards, and packer rows of several."""
    import random

    from trainer.prepare import prepare

    words = stdlib_words("textwrap.py", "json/__init__.py", "argparse.py", "difflib.py")
    rng = random.Random(0)
    lines = []
    for s, scale in enumerate(SHORT_SHARD_SCALES):
        for i in range(docs_per_shard):
            n = max(3, int(rng.lognormvariate(3.3, 0.8) * scale))
            start = rng.randrange(len(words) - n)
            lines.append(json.dumps({"text": " ".join(words[start:start + n]), "id": f"s{s}d{i}"}) + "\n")
    source = out.parent / f"{out.name}.jsonl"
    source.write_text("".join(lines))
    prepare(f"jsonl:{source}", out, vocab_size=300, docs_per_shard=docs_per_shard, val_fraction=0.0, seed=0)
    return out


HF_TEXTS = ("def parse(text): return text.split()", "the cat sat on the mat", "Ωμέγα ∑ tab\tend",
            " leading space")
"""Texts a tiny Hugging Face tokenizer is trained on and checked with."""
LLAMA3 = ("<|begin_of_text|>", "<|end_of_text|>")
"""Llama-3's BOS and EOS."""


def hf_tokenizer_dir(out: Path, specials: tuple[str, ...], *, eos: str, bos: str | None = None,
                     pad: str | None = None, post_processor: str | None = None, **config) -> Path:
    """A tiny byte-level BPE saved as transformers saves a model's tokenizer (tokenizer.json and
    tokenizer_config.json), `specials` its first ids. `post_processor`: a TemplateProcessing single template
    such as "<s> $A" (Llama-3's adds BOS so); `config`: keys written into tokenizer_config.json afterwards
    (None removes one), e.g. add_bos_token=True, chat_template=... Example: ("<|endoftext|>",),
    eos="<|endoftext|>": GPT-2's layout."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(HF_TEXTS) * 10, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if post_processor is not None:
        names = [t for t in post_processor.split() if t in specials]
        tok.post_processor = processors.TemplateProcessing(
            single=post_processor, pair=f"{post_processor} {post_processor.replace('$A', '$B:1')}",
            special_tokens=[(t, tok.token_to_id(t)) for t in dict.fromkeys(names)])
    named = {k: v for k, v in (("eos_token", eos), ("bos_token", bos), ("pad_token", pad)) if v is not None}
    PreTrainedTokenizerFast(tokenizer_object=tok, **named).save_pretrained(out)
    file = out / "tokenizer_config.json"
    saved = json.loads(file.read_text()) | config
    file.write_text(json.dumps({k: v for k, v in saved.items() if v is not None}))
    return out


def sources_override(*sources: tuple[str, Path, float]) -> str:
    """The data.sources override of (name, prepared dir, weight) triples.
    Example: ("short", /d/s, 0.7) -> "data.sources=[{name:short,path:'/d/s',weight:0.7}]"."""
    entries = ",".join(f"{{name:{name},path:'{path}',weight:{weight}}}" for name, path, weight in sources)
    return f"data.sources=[{entries}]"


def mixture_corpora(root: Path, docs_per_shard: int = 40, shards: int = 4) -> tuple[Path, Path]:
    """Two prepared sources with different length profiles and one tokenizer: `short` (3 to 40 words) and
    `long` (60 to 300 words), `shards` shards each, words from standard-library sources. Keys are "short--<n>"
    and "long--<n>" (trainer.prepare names samples by the source file): the key names the source, a reference
    that does not use Document.source."""
    import random

    from trainer.prepare import prepare

    words = stdlib_words("textwrap.py", "json/__init__.py", "argparse.py")
    rng = random.Random(1)
    out = []
    for name, (lo, hi) in (("short", (3, 40)), ("long", (60, 300))):
        lines = []
        for _ in range(shards * docs_per_shard):
            n = rng.randint(lo, hi)
            start = rng.randrange(len(words) - n)
            lines.append(json.dumps({"text": " ".join(words[start:start + n])}) + "\n")
        source = root / f"{name}.jsonl"
        source.write_text("".join(lines))
        tokenizer = None if not out else out[0] / "tokenizer"
        prepare(f"jsonl:{source}", root / name, vocab_size=300, tokenizer=tokenizer,
                docs_per_shard=docs_per_shard, val_fraction=0.0, seed=0)
        out.append(root / name)
    return out[0], out[1]


def epoch_chunks(data: Path, seq_len: int) -> Counter:
    """The chunks of one epoch of `data`'s train split, made without the trainer's reader: each shard opened
    with tarfile, each `<key>.txt` encoded by the `tokenizers` library, + 1 for the appended EOS, named `key`
    or, over seq_len tokens, `key#0` .. `key#k` (the trainer's split): what every epoch must consume exactly
    once."""
    import math
    import tarfile

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(data / "tokenizer" / "tokenizer.json"))
    manifest = json.loads((data / "manifest.json").read_text())
    chunks: Counter = Counter()
    for shard in manifest["splits"]["train"]["shards"]:
        with tarfile.open(data / shard["name"]) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.endswith(".txt"):
                    key = member.name.rsplit("/", 1)[-1].split(".", 1)[0]
                    text = tar.extractfile(member).read().decode("utf-8")
                    n = len(tokenizer.encode(text, add_special_tokens=False).ids) + 1
                    chunks.update([key] if n <= seq_len
                                  else [f"{key}#{i}" for i in range(math.ceil(n / seq_len))])
    return chunks


def stream_rows(data: Path, rank: int, world_size: int, workers: int, seq_len: int, shuffle_buffer: int = 8,
                packer_buffer: int = 8):
    """A rank's RowStream over `data`'s train shards as trainer.data.feed.build_data makes it (lockstep, the
    manifest's tokens, seed 0), in this process (workers 0: read in-process, one reader)."""
    from trainer.data.config import DataConfig, PackingConfig
    from trainer.data.loader import DocumentLoader
    from trainer.data.pipeline import RowStream
    from trainer.data.sources import resolve_source
    from trainer.data.stream import DocumentStream, manifest_tokens
    from trainer.data.tokenizer import load_tokenizer, special_ids

    source = resolve_source(DataConfig(path=str(data)))
    eos = special_ids(load_tokenizer(source.tokenizer_dir)).eos
    stream = DocumentStream(source.train_urls, source.tokenizer_dir, eos, seed=0, rank=rank,
                            world_size=world_size, shuffle_buffer=shuffle_buffer,
                            expected_docs=source.expected_docs,
                            shard_tokens=manifest_tokens(source.train_urls, source.manifest))
    loader = DocumentLoader(stream, num_workers=workers, lockstep=True)
    return RowStream(loader, seq_len, PackingConfig(buffer_size=packer_buffer))


def first_keys_of_epoch(rows, epoch: int, n_rows: int) -> list[str]:
    """The keys of the first `n_rows` rows of `epoch` of a fresh `stream_rows` stream: what a run on its shape
    trains first in that epoch (an epoch starts with empty packers, trainer.data.pipeline)."""
    from trainer.data.reader import SlotState

    workers = max(1, rows.docs.num_workers)
    first = rows.docs.stream.rank * workers
    rows.docs.lockstep_epoch = epoch
    rows.docs.slot_states = {slot: SlotState(epoch=epoch) for slot in range(first, first + workers)}
    try:
        return [doc.key for row in rows.take(n_rows) for doc in row]
    finally:
        rows.close()


def doc_keys(run_dir: Path) -> dict[int, dict[int, list[str]]]:
    """{rank: {step: keys}} from a run's logging.record_doc_keys files."""
    out = {}
    for path in sorted((run_dir / "doc_keys").glob("rank_*.jsonl")):
        out[int(path.stem.split("_")[1])] = {r["step"]: r["keys"]
                                             for r in map(json.loads, path.read_text().splitlines())}
    return out


# ---------------------------------------------------------------------------------------------------
# An HTTP shard server (tests/data/test_remote.py, tests/data/test_resume_cost.py)
# ---------------------------------------------------------------------------------------------------


class ShardHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the data directory; `server.cuts[name] = n` cuts the next n responses for that file in half."""

    def do_GET(self) -> None:
        name = self.path.lstrip("/")
        self.server.requests[name].append(self.headers.get("User-Agent", ""))
        if self.server.cuts.get(name, 0) > 0:
            self.server.cuts[name] -= 1
            data = (Path(self.directory) / name).read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.close_connection = True
            return
        super().do_GET()

    def log_message(self, *args) -> None:
        pass


class ShardServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        pass  # a reader that stops early resets its connection: not news

    def curl_gets(self, name: str) -> int:
        """GET requests for `name` made by curl (the reader), not by the status probe (urllib)."""
        return sum(agent.startswith("curl/") for agent in self.requests[name])


@contextlib.contextmanager
def serve_shards(directory: Path, handler: type = None):
    """A real local HTTP server for the files of `directory` (handler: ShardHandler or a subclass), in a
    thread; `server.base` is its URL."""
    server = ShardServer(("127.0.0.1", 0),
                         functools.partial(handler or ShardHandler, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------------------------------
# The package's import graph and its layers (tests/test_architecture.py)
# ---------------------------------------------------------------------------------------------------

PACKAGE = ROOT / "trainer"
LAYERS: list[set[str]] = [
    {"trainer.errors", "trainer.registry"},  # shared vocabulary: imports nothing of the package
    {"trainer.data"},  # shards -> documents -> rows -> batches
    {"trainer.model"},  # single-device GPT, attention kernels, losses
    {"trainer.distributed"},  # process groups and engines
    {"trainer.checkpoint"},  # the checkpoint store and everything that reads weights
    {"trainer.tasks"},  # downstream tasks: task files, built-ins, packed scoring, metrics
    {"trainer.config"},  # the typed config, assembled from the rooms' sections
    {"trainer.reporting"},  # runs compared from their files (reads the registry and manifests only)
    {"trainer.run"},  # the loop and its parts
    {"trainer.outputs"},  # where a command may write
    {"trainer.train", "trainer.prepare", "trainer.report", "trainer.inspect_mask", "trainer.export",
     "trainer.generate", "trainer.evaluate", "trainer.launcher", "trainer.harness", "trainer.certify",
     "trainer"},
]
"""Each module may import from its own layer and the layers above it in this list (lower = more basic).
A room is a subpackage or a root module; `trainer.data.config` belongs to `trainer.data`."""


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """trainer module -> the trainer modules it imports (at the top, inside functions, under
    TYPE_CHECKING)."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainer"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & mods.keys()
                # `from pkg import submodule` depends on the submodule; `from pkg import name` on the package
                graph[name] |= subs if len(subs) == len(node.names) else subs | ({node.module} & mods.keys())
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names} & mods.keys()
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(node)

    for start in sorted(graph):
        if start not in done:
            visit(start, [start])
    return found


def room(module: str) -> str:
    """The room of a module: its subpackage (trainer.data.stream -> trainer.data) or itself at the root."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() else module


def layer(module: str) -> int:
    r = room(module)
    return next(i for i, rooms in enumerate(LAYERS) if r in rooms)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for each import of a module from a higher layer (a room that should depend on a, not a on
    it)."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if room(a) != room(b) and layer(b) > layer(a))
