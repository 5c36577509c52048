"""Prepare benchmark (not a test): the streaming, parallel `python -m trainer.prepare` against the tokenizer
alone, its speedup with workers, its peak memory as the corpus grows, and one corpus as parquet and
.jsonl.zst.

    python bench/prepare.py                                   # 1x and 16x, --workers 1 and 2 (~12 min)
    python bench/prepare.py --quick                           # smoke test: a 5 MB corpus, 1x only (< 1 min)
    python bench/prepare.py --rounds 2 --json /tmp/prepare.json  # best of 2 interleaved rounds
    python bench/prepare.py --sizes 1,4 --workers 1,2
    python bench/prepare.py --work-dir /tmp/bench_prepare --unit-mb 4
    git archive HEAD | tar -x -C /tmp/packtrain-head && python bench/prepare.py --code /tmp/packtrain-head

The corpus is real English text from this machine, built once under --work-dir and cached there: the English
man pages (/usr/share/man/man*/*.gz; symlinks, `.so` redirections and the ~16,600 generated `gcloud*` pages
skipped), read with gzip, roff markup stripped crudely (requests dropped, font and character escapes removed),
one document per `.SH` section, identical sections kept once. Pages are taken in the order of a sha1 of their
path (an interleave of all sections, deterministic on one machine) until --corpus-mb of text:
`1x/corpus.jsonl`, records {"text": ...}. The Nx corpus is the 1x records repeated N times (its documents are
repeats: fine for memory and speed; the prepare keys documents by file stem + record number). The largest size
is also written as `corpus.parquet` (pyarrow, row groups of 10,000 rows) and `corpus.jsonl.zst` (zstandard
level 3): the same records under the same stem.

Steps, all in one run:
1. Tokenizer training: one prepare of the 1x corpus that trains the tokenizer (timed, reported apart). Every
   timed prepare gets `--tokenizer` of that run, so it times the streaming pass only.
2. Tokenizer alone: a fresh interpreter per pass, TOKENIZERS_PARALLELISM=false and RAYON_NUM_THREADS=1 set
   before tokenizers is imported, encodes the 1x documents (already in memory) in batches of --batch as a
   prepare would: `encode_batch(texts, add_special_tokens=False)`, and `encode_batch_fast` where tokenizers
   has it. The faster method (its best pass) is the ceiling.
3. `python -m trainer.prepare --source jsonl:... --tokenizer ... --workers W` for every size and W: wall time
   of the command (interpreter start included), MB/s of document text (UTF-8 bytes of the "text" fields),
   docs/s, units (from the prepare's last status line), CPU seconds of the process tree (getrusage of the
   reaped children) and the peak RSS of the process tree (the prepare and all its descendants, summed, sampled
   with psutil every --sample-ms; pages shared between processes count once per process, as RSS does).
   "other CPU s" is the busy CPU time of the whole machine (/proc/stat) during a run minus the run's own:
   other jobs, which slow every figure here (a clean run shows ~0-2 s, the RSS sampler's share).
   --rounds R repeats 2 and 3 R times, interleaved (this 2-core VM's speed drifts by up to ~1.5x over minutes
   even with nothing else running): times are the best of the rounds, peak RSS the highest.
4. Formats: the largest corpus as parquet and as .jsonl.zst, --workers max(W), once: wall time of each, and
   whether the two manifests' "splits" (docs, tokens, per-shard name/docs/tokens) are IDENTICAL (exit status 1
   if DIFFERENT).

Targets (issue 19, on the 2-core CI machine), checked at every size: workers 2 / workers 1 >= 1.6 (MB/s),
workers 1 / tokenizer alone >= 0.6 (MB/s), peak RSS 16x / 1x <= 1.5 at each worker count. A prepare that fails
ends the benchmark with exit status 1.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAN_GLOB = "/usr/share/man/man*/*.gz"
SKIP_PAGES = ("gcloud",)
"""Page names skipped: the Google Cloud CLI's ~16,600 generated reference pages, 3/4 of all pages here."""
CORPUS_VERSION = 2
"""Raise when the corpus recipe changes: a cached corpus of another version is built again."""

TARGET_SPEEDUP_2 = 1.6
"""workers 2 / workers 1, MB/s."""
TARGET_VS_TOKENIZER = 0.6
"""workers 1 / tokenizer alone (the faster encode method), MB/s."""
TARGET_MEMORY_GROWTH = 1.5
"""peak RSS of the process tree, 16x corpus / 1x corpus, same worker count."""

PARQUET_ROW_GROUP = 10_000
MIN_DOC_CHARS = 200


# ---------------------------------------------------------------------------------------------
# Corpus: English man pages, roff stripped, one document per .SH section
# ---------------------------------------------------------------------------------------------

_CHARS = {"em": " -- ", "en": "-", "hy": "-", "bu": "*", "aq": "'", "dq": '"', "lq": '"', "rq": '"',
          "oq": "'", "cq": "'", "co": "(c)", "rg": "(R)", "tm": "(TM)", "mi": "-", "pl": "+", "mu": "x",
          "<=": "<=", ">=": ">=", "->": "->", "<-": "<-", "ti": "~", "ha": "^", "rs": "\\", "ga": "`",
          "aa": "'", "ul": "_", "de": " degrees", "sc": "S", "Fo": '"', "Fc": '"', "L\"": '"', "R\"": '"',
          "C`": '"', "C'": '"'}

_ESCAPE = re.compile(
    r"\\(?:"
    r"f(?:\[[^\]]*\]|\(..|.)"  # font: \fB \f(CW \f[BI]
    r"|s[+-]?(?:\d+|\(\d\d|\[\d+\])"  # size: \s-1 \s+2 \s(12
    r"|\*(?:\[(?P<s1>[^\]]*)\]|\((?P<s2>..)|(?P<s3>.))"  # string: \*(lq \*[name] \*x
    r"|\((?P<c2>..)"  # character: \(em
    r"|\[(?P<c1>[^\]]*)\]"  # character: \[em]
    r"|n(?:\[[^\]]*\]|\(..|.)"  # number register
    r"|[kgwhvlLxDoHSzYVRN]'[^']*'|[hvwlLxDoHSNRZbz]\[[^\]]*\]"  # requests with an argument
    r"|(?P<lit>.)"  # one character: \- \e \& \  \| \^ \c \%
    r")"
)
_LITERAL = {"-": "-", "e": "\\", " ": " ", "~": " ", "0": " ", "\\": "\\", ".": ".", "'": "'", "`": "`"}
_REQUEST = re.compile(r"^[.']\s*(\S+)\s*(.*)$")
_ARG = re.compile(r'"((?:[^"]|"")*)"?|(\S+)')


def _unescape(m: re.Match) -> str:
    s = m.group("s1") or m.group("s2") or m.group("s3")
    if s is not None:
        return _CHARS.get(s, "")
    c = m.group("c1") or m.group("c2")
    if c is not None:
        return _CHARS.get(c, "")
    lit = m.group("lit")
    if lit is not None:
        return _LITERAL.get(lit, "")
    return ""


def _args(rest: str) -> list[str]:
    return [(m.group(1) if m.group(1) is not None else m.group(2)).replace('""', '"')
            for m in _ARG.finditer(rest)]


_MDOC_MACRO = re.compile(r"^[A-Z][a-z]$")


def man_sections(src: str) -> tuple[str, list[tuple[str, str]]]:
    """The page's title and its (heading, text) sections, roff (man or mdoc) stripped. Example: gzip.1 ->
    ("GZIP(1)", [("NAME", "gzip, gunzip, zcat - compress or expand files"), ("SYNOPSIS", ...), ...])."""
    title, sections, heading = "", [], None
    paras: list[str] = []
    line_buf: list[str] = []
    nofill, skip_until, heading_next = False, None, False

    def end_para() -> None:
        if line_buf:
            paras.append(("\n" if nofill else " ").join(line_buf).strip())
            line_buf.clear()

    def end_section() -> None:
        end_para()
        text = "\n\n".join(p for p in paras if p)
        if heading is not None and text:
            sections.append((heading, text))
        paras.clear()

    def words(rest: str) -> list[str]:
        return _args(_ESCAPE.sub(_unescape, rest))

    for raw in src.splitlines():
        if skip_until is not None:
            if raw.strip() == skip_until:
                skip_until = None
            continue
        if raw.startswith(('.\\"', "'\\\"", '\\"', ".\\#")):
            continue
        m = _REQUEST.match(raw) if raw[:1] in (".", "'") else None
        if m:
            req, rest = m.groups()
            if req in ("de", "de1", "am", "ig"):
                skip_until = ".."
            elif req in ("TH", "Dt"):
                a = words(rest)
                title = f"{a[0]}({a[1]})" if len(a) >= 2 else (a[0] if a else "")
            elif req in ("SH", "Sh"):
                end_section()
                heading = " ".join(words(rest)).strip()
                heading_next = not heading
            elif req in ("SS", "Ss"):
                end_para()
                paras.append(" ".join(words(rest)).strip())
            elif req in ("B", "I", "SM", "SB"):
                line_buf.append(" ".join(words(rest)))
            elif req in ("BR", "RB", "IR", "RI", "BI", "IB"):
                line_buf.append("".join(words(rest)))
            elif req in ("PP", "P", "LP", "Pp", "sp", "TP", "HP", "RS", "RE", "TS", "TE", "Bl", "El", "Bd",
                         "Ed"):
                end_para()
            elif req in ("IP", "TQ", "It"):
                end_para()
                tag = " ".join(w for w in words(rest) if not _MDOC_MACRO.match(w)).strip()
                if tag:
                    line_buf.append(tag)
            elif req in ("nf", "EX"):
                end_para()
                nofill = True
            elif req in ("fi", "EE"):
                end_para()
                nofill = False
            elif _MDOC_MACRO.match(req) and req not in ("Os", "Dd", "Bk", "Ek"):
                # mdoc inline: .Nm .Fl .Ar .Xr ...
                a = [w for w in words(rest) if not _MDOC_MACRO.match(w)]
                if a:
                    line_buf.append(("-" if req == "Fl" else "") + " ".join(a))
            continue  # other requests (.ft .in .ll .if .ie .ds .nr .so .br ...): dropped
        text = _ESCAPE.sub(_unescape, raw).rstrip()
        if not text.strip():
            end_para()
        elif heading_next:
            heading, heading_next = text.strip(), False
        else:
            line_buf.append(text)
    end_section()
    return title, sections


def man_documents(target_bytes: int):
    """Yield {"text": ...} records (one per .SH section of >= MIN_DOC_CHARS characters, each distinct text
    once) until target_bytes of UTF-8 text; pages in the order of sha1(path)."""
    import glob

    pages = [p for p in glob.glob(MAN_GLOB)
             if not os.path.islink(p) and not os.path.basename(p).startswith(SKIP_PAGES)]
    pages.sort(key=lambda p: hashlib.sha1(p.encode()).hexdigest())
    seen: set[bytes] = set()
    total = 0
    for path in pages:
        try:
            src = gzip.decompress(Path(path).read_bytes()).decode("utf-8", errors="replace")
        except (OSError, EOFError):
            continue
        if src.lstrip().startswith(".so "):
            continue
        title, sections = man_sections(src)
        name = title or Path(path).name[: -len(".gz")]
        for heading, body in sections:
            text = f"{name}: {heading}\n\n{body}"
            if len(text) < MIN_DOC_CHARS:
                continue
            digest = hashlib.sha1(text.encode()).digest()
            if digest in seen:
                continue
            seen.add(digest)
            total += len(text.encode("utf-8"))
            yield {"text": text}
            if total >= target_bytes:
                return


def build_base(work: Path, corpus_mb: float) -> dict:
    """work/1x/corpus.jsonl and work/1x/meta.json ({"docs", "text_bytes", "file_bytes"}), unless present."""
    d = work / "1x"
    meta_path = d / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("corpus_mb") == corpus_mb and meta.get("version") == CORPUS_VERSION:
            return meta
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    docs = text_bytes = 0
    tmp = d / "corpus.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in man_documents(int(corpus_mb * 1e6)):
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            docs += 1
            text_bytes += len(rec["text"].encode("utf-8"))
    tmp.replace(d / "corpus.jsonl")
    meta = {"corpus_mb": corpus_mb, "version": CORPUS_VERSION, "docs": docs, "text_bytes": text_bytes,
            "file_bytes": (d / "corpus.jsonl").stat().st_size, "source": MAN_GLOB}
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    print(f"built {d / 'corpus.jsonl'}: {docs:,} docs, {text_bytes / 1e6:.1f} MB of text "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    return meta


def build_scaled(work: Path, base: dict, n: int) -> dict:
    """work/{n}x/corpus.jsonl: the 1x lines repeated n times (n = 1: the 1x directory itself)."""
    if n == 1:
        return {**base, "dir": str(work / "1x")}
    d = work / f"{n}x"
    meta_path = d / "meta.json"
    want = {"corpus_mb": base["corpus_mb"], "version": CORPUS_VERSION, "docs": base["docs"] * n,
            "text_bytes": base["text_bytes"] * n,
            "file_bytes": base["file_bytes"] * n, "source": f"1x repeated {n} times"}
    if meta_path.is_file() and json.loads(meta_path.read_text()) == want:
        return {**want, "dir": str(d)}
    d.mkdir(parents=True, exist_ok=True)
    lines = (work / "1x" / "corpus.jsonl").read_bytes()
    with open(d / "corpus.jsonl.tmp", "wb") as f:
        for _ in range(n):
            f.write(lines)
    (d / "corpus.jsonl.tmp").replace(d / "corpus.jsonl")
    for stale in ("parquet", "zst"):
        shutil.rmtree(d / stale, ignore_errors=True)
    meta_path.write_text(json.dumps(want, indent=2) + "\n")
    return {**want, "dir": str(d)}


def build_formats(corpus: dict) -> dict[str, Path]:
    """DIR/parquet/corpus.parquet and DIR/zst/corpus.jsonl.zst from DIR/corpus.jsonl (same records, same
    stem), unless present and newer than it."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    d = Path(corpus["dir"])
    src = d / "corpus.jsonl"
    out = {"parquet": d / "parquet" / "corpus.parquet", "jsonl.zst": d / "zst" / "corpus.jsonl.zst"}
    def stale(path: Path) -> bool:
        return not path.is_file() or path.stat().st_mtime < src.stat().st_mtime

    if stale(out["parquet"]):
        out["parquet"].parent.mkdir(exist_ok=True)
        tmp = out["parquet"].with_suffix(".tmp")
        schema = pa.schema([("text", pa.string())])
        with pq.ParquetWriter(tmp, schema) as w, open(src, encoding="utf-8") as f:
            rows: list[str] = []
            for line in f:
                rows.append(json.loads(line)["text"])
                if len(rows) == PARQUET_ROW_GROUP:
                    w.write_table(pa.table({"text": rows}, schema=schema), row_group_size=PARQUET_ROW_GROUP)
                    rows = []
            if rows:
                w.write_table(pa.table({"text": rows}, schema=schema), row_group_size=PARQUET_ROW_GROUP)
        tmp.replace(out["parquet"])
    if stale(out["jsonl.zst"]):
        out["jsonl.zst"].parent.mkdir(exist_ok=True)
        tmp = out["jsonl.zst"].with_suffix(".tmp")
        with open(src, "rb") as f, open(tmp, "wb") as g:
            zstandard.ZstdCompressor(level=3).copy_stream(f, g)
        tmp.replace(out["jsonl.zst"])
    return out


# ---------------------------------------------------------------------------------------------
# The tokenizer alone (subprocess, single-threaded)
# ---------------------------------------------------------------------------------------------


def tokenize_alone_child(argv: list[str]) -> None:
    """`bench/prepare.py _tokenize TOKDIR CORPUS BATCH METHOD`: one timed pass; print one JSON line."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    tok_dir, corpus, batch, method = argv[0], argv[1], int(argv[2]), argv[3]
    import tokenizers
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    fn = getattr(tok, method)
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(texts), batch):
        tokens += sum(len(e.ids) for e in fn(texts[i : i + batch], add_special_tokens=False))
    seconds = time.perf_counter() - t0
    print(json.dumps({"tokenizers": tokenizers.__version__, "method": method, "docs": len(texts),
                      "tokens": tokens, "text_bytes": sum(len(t.encode("utf-8")) for t in texts),
                      "seconds": seconds}))


def tokenizer_methods() -> list[str]:
    from tokenizers import Tokenizer

    return ["encode_batch"] + (["encode_batch_fast"] if hasattr(Tokenizer, "encode_batch_fast") else [])


def tokenize_pass(tok_dir: Path, corpus: Path, batch: int, method: str) -> dict:
    """One pass of the tokenizer alone over the corpus, in a fresh single-threaded interpreter."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
    before, busy0 = resource.getrusage(resource.RUSAGE_CHILDREN), busy_cpu_s()
    proc = subprocess.run([sys.executable, __file__, "_tokenize", str(tok_dir), str(corpus), str(batch),
                           method], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"tokenizer-alone subprocess failed ({proc.returncode}):\n{proc.stderr}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {**json.loads(proc.stdout.strip().splitlines()[-1]),
            "other_cpu_s": max(0.0, busy_cpu_s() - busy0 - own)}


def tokenizer_summary(passes: list[dict], batch: int) -> dict:
    """Best pass per method (MB/s, docs/s) and the faster method: the ceiling."""
    r = {"tokenizers": passes[0]["tokenizers"], "docs": passes[0]["docs"],
         "text_bytes": passes[0]["text_bytes"], "batch": batch, "methods": {}, "passes": passes}
    for p in passes:
        m = r["methods"].setdefault(p["method"],
                                    {"seconds": float("inf"), "tokens": p["tokens"], "all_s": []})
        m["all_s"].append(p["seconds"])
        if p["seconds"] < m["seconds"]:
            m["seconds"], m["other_cpu_s"] = p["seconds"], p["other_cpu_s"]
    for m in r["methods"].values():
        m["mb_per_s"] = r["text_bytes"] / 1e6 / m["seconds"]
        m["docs_per_s"] = r["docs"] / m["seconds"]
    r["best"] = max(r["methods"], key=lambda k: r["methods"][k]["mb_per_s"])
    return r


# ---------------------------------------------------------------------------------------------
# One prepare: wall time, CPU time and peak RSS of its process tree
# ---------------------------------------------------------------------------------------------


class TreeRSS:
    """Peak of the summed RSS of a process and all its descendants, sampled every `interval` seconds."""

    def __init__(self, pid: int, interval: float) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.interval = interval
        self.peak = 0
        self.peak_procs = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                break
            total = 0
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            if total > self.peak:
                self.peak, self.peak_procs = total, len(procs)
            self.samples += 1
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (not idle/iowait, steal included) since boot,
    from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def run_prepare(source: str, out: Path, args, *, workers: int, tokenizer: Path | None, log: Path) -> dict:
    """`python -m trainer.prepare --source SOURCE --out OUT --workers W [--tokenizer T]`,
    OUT emptied first."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "trainer.prepare", "--source", source, "--out", str(out),
           "--workers", str(workers)]
    if tokenizer is not None:
        cmd += ["--tokenizer", str(tokenizer)]
    if args.unit_mb is not None:
        cmd += ["--unit-mb", str(args.unit_mb)]
    cmd += args.prepare_arg
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0 = busy_cpu_s()
    with open(log, "w") as logf:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=args.code, stdout=logf, stderr=subprocess.STDOUT)
        sampler = TreeRSS(proc.pid, args.sample_ms / 1000)
        rc = proc.wait()
        wall = time.perf_counter() - t0
        sampler.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    # everything else on the machine, this benchmark's sampler included
    other = max(0.0, busy_cpu_s() - busy0 - cpu)
    r = {"command": " ".join(["python", *cmd[1:]]), "rc": rc, "wall_s": wall, "cpu_s": cpu,
         "other_cpu_s": other, "peak_rss": sampler.peak, "peak_procs": sampler.peak_procs,
         "rss_samples": sampler.samples, "log": str(log)}
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-20:]
        print(f"FAILED (exit {rc}): {r['command']}\n  " + "\n  ".join(tail), file=sys.stderr, flush=True)
        return r
    manifest = json.loads((out / "manifest.json").read_text())
    r["manifest"] = manifest
    r["docs"] = sum(s["docs"] for s in manifest["splits"].values())
    r["tokens"] = sum(s["tokens"] for s in manifest["splits"].values())
    return r


def splits_key(manifest: dict) -> dict:
    """What must not depend on the input format: per split docs, tokens and per-shard (name, docs, tokens)."""
    return {name: {"docs": s["docs"], "tokens": s["tokens"],
                   "shards": [(sh.get("name"), sh.get("docs"), sh.get("tokens")) for sh in s["shards"]]}
            for name, s in sorted(manifest["splits"].items())}


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def machine() -> dict:
    def sh(cmd: str) -> str:
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""

    return {"nproc": sh("nproc"), "cpu": sh("lscpu | grep 'Model name' | sed 's/.*: *//'"),
            "mem_total_gib": sh("free -g | awk '/^Mem:/ {print $2}'"), "load_before": sh("cat /proc/loadavg"),
            "python": platform.python_version()}


def code_version(code: Path) -> dict:
    """The tree the prepares run from: its path, and where it is a git checkout,
    HEAD and its changed trainer/ files."""
    def git(*a: str) -> str:
        proc = subprocess.run(["git", "-C", str(code), *a], capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    return {"path": str(code), "head": git("rev-parse", "--short", "HEAD"),
            "changed": git("status", "--short", "--", "trainer").splitlines()}


_UNITS_RE = re.compile(r"preparing: (\d+)/(\d+) units")


def log_units(log: str | Path) -> int | None:
    """The unit count the prepare's last status line shows ("preparing: 12/12 units, ..."), if any."""
    found = _UNITS_RE.findall(Path(log).read_text(errors="replace"))
    return int(found[-1][1]) if found else None


def shard_layout(manifest: dict) -> str:
    return " + ".join(f"{len(s['shards'])} {name}" for name, s in sorted(manifest["splits"].items()))


def compare(name: str, a: dict, b: dict, required: bool) -> dict:
    """IDENTICAL when splits_key agrees; else DIFFERENT,
    saying whether per-split docs/tokens at least agree."""
    ka, kb = splits_key(a["manifest"]), splits_key(b["manifest"])
    if ka == kb:
        return {"name": name, "required": required, "result": "IDENTICAL", "detail": ""}
    totals = ka.keys() == kb.keys() and all(
        ka[s]["docs"] == kb[s]["docs"] and ka[s]["tokens"] == kb[s]["tokens"] for s in ka)
    detail = (("per-split docs and tokens equal; " if totals else "per-split docs/tokens differ; ")
              + f"shards {shard_layout(a['manifest'])} vs {shard_layout(b['manifest'])}")
    return {"name": name, "required": required, "result": "DIFFERENT", "detail": detail}


def row(label: str, r: dict) -> str:
    if r["rc"] != 0:
        return (f"| {label} | {r['size']}x | {r['text_bytes'] / 1e6:.1f} | - | - | FAILED (exit {r['rc']}) "
                "| | | | | |")
    units = r.get("units") if r.get("units") is not None else "?"
    return (f"| {label} | {r['size']}x | {r['text_bytes'] / 1e6:.1f} | {units} | {r['docs']:,} | "
            f"{r['wall_s']:.2f} | {r['cpu_s']:.1f} | {r['other_cpu_s']:.1f} | {r['mb_per_s']:.2f} | "
            f"{r['docs_per_s']:,.0f} | {r['peak_rss'] / 2**20:,.0f} ({r['peak_procs']}) |")


def report(res: dict) -> list[str]:
    out = []
    tok, tr = res["tokenizer_alone"], res["train_run"]
    out.append(f"Tokenizer training run (1x corpus, --workers {tr['workers']}, no --tokenizer): "
               f"{tr['wall_s']:.1f} s wall, {tr['cpu_s']:.1f} CPU s, "
               f"peak RSS {tr['peak_rss'] / 2**20:,.0f} MiB")
    tc = res["tokens_check"]
    out.append(f"Tokens of the 1x corpus: prepare {tc['prepare']:,}, tokenizer alone + 1 EOS per document "
               f"{tc['tokenizer_alone_plus_eos']:,}: {tc['result']}")
    rounds = res["rounds"]
    out.append(f"Times: best of {rounds} round(s) (tokenizer alone: best of {rounds} fresh-process pass(es) "
               "per method, interleaved with the prepares); peak RSS: the highest of the rounds.")
    out.append("")
    out.append("| run | corpus | text MB | units | docs | wall s | CPU s | other CPU s | MB/s | docs/s | "
               "peak RSS MiB (procs) |")
    out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, m in tok["methods"].items():
        star = " (ceiling)" if name == tok["best"] else ""
        spread = "/".join(f"{x:.1f}" for x in m["all_s"])
        out.append(f"| tokenizer alone, `{name}`{star} | 1x | {tok['text_bytes'] / 1e6:.1f} | - | "
                   f"{tok['docs']:,} | {m['seconds']:.2f} ({spread}) | - | {m['other_cpu_s']:.1f} | "
                   f"{m['mb_per_s']:.2f} | {m['docs_per_s']:,.0f} | - |")
    for r in res["runs"]:
        out.append(row(f"prepare --workers {r['workers']}", r))
    for f in res["formats"]:
        out.append(row(f"prepare --workers {f['workers']}, {f['format']} "
                       f"({f['file_bytes'] / 1e6:.0f} MB file)", f))
    out.append("")
    out.append("| check | value | target | result |")
    out.append("|---|---:|---:|---|")
    for c in res["checks"]:
        out.append(f"| {c['name']} | {c['value']:.2f} | {c['op']} {c['target']} | {c['result']} |")
    for c in res["identical"]:
        detail = f" ({c['detail']})" if c["detail"] else ""
        out.append(f"| {c['name']}{'' if c['required'] else ' (information)'} | - | identical | "
                   f"{c['result']}{detail} |")
    return out


def best_of(runs: list[dict]) -> dict:
    """The fastest successful run (or the first failure), with the highest peak RSS of all."""
    bad = [r for r in runs if r["rc"] != 0]
    if bad:
        return bad[0]
    best = dict(min(runs, key=lambda r: r["wall_s"]))
    top = max(runs, key=lambda r: r["peak_rss"])
    best.update(peak_rss=top["peak_rss"], peak_procs=top["peak_procs"],
                all_wall_s=[r["wall_s"] for r in runs], all_peak_rss=[r["peak_rss"] for r in runs])
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/bench_prepare"),
                   help="corpora (cached) and prepare outputs (default /tmp/bench_prepare)")
    p.add_argument("--sizes", default="1,16",
                   help="corpus sizes as multiples of the 1x corpus (default 1,16)")
    p.add_argument("--workers", default="1,2", help="prepare --workers values (default 1,2)")
    p.add_argument("--corpus-mb", type=float, default=16.0, help="MB of text in the 1x corpus (default 16)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: a 5 MB corpus (2 units), 1x only, one round")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of (tokenizer alone, every prepare); best time of the rounds (default 1)")
    p.add_argument("--unit-mb", type=float,
                   help="pass --unit-mb to every prepare (default: the prepare's own)")
    p.add_argument("--prepare-arg", action="append", default=[],
                   help="one more argument for every prepare "
                        "(repeat; e.g. --prepare-arg=--docs-per-shard=5000)")
    p.add_argument("--batch", type=int, default=512, help="documents per encode_batch call, tokenizer alone")
    p.add_argument("--sample-ms", type=float, default=50.0, help="RSS sampling interval (default 50 ms)")
    p.add_argument("--skip-formats", action="store_true")
    p.add_argument("--code", type=Path, default=ROOT,
                   help="run `python -m trainer.prepare` from this packtrain tree "
                        "(e.g. a `git archive` of a commit)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()
    if args.quick:
        args.corpus_mb, args.sizes, args.rounds = 5.0, "1", 1
        args.work_dir = args.work_dir / "quick"
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    workers = sorted({int(w) for w in args.workers.split(",")})
    work: Path = args.work_dir
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    args.code = args.code.resolve()

    res: dict = {"machine": machine(), "code": code_version(args.code), "rounds": args.rounds,
                 "args": {k: str(v) for k, v in vars(args).items()}, "runs": [], "formats": [], "checks": [],
                 "identical": []}
    print(f"machine: {res['machine']}\ncode: {res['code']}", flush=True)
    base = build_base(work, args.corpus_mb)
    corpora = {n: build_scaled(work, base, n) for n in sizes}
    big, wmax = max(sizes), max(workers)
    formats = {} if args.skip_formats else build_formats(corpora[big])
    one = work / "1x" / "corpus.jsonl"

    # 1. the tokenizer, trained once by a prepare of the 1x corpus
    train = run_prepare(f"jsonl:{one}", work / "out" / "train-tokenizer", args, workers=wmax, tokenizer=None,
                        log=logs / "train-tokenizer.log")
    train.update(workers=wmax, size=1, text_bytes=base["text_bytes"])
    res["train_run"] = train
    print(f"tokenizer training run: {train['wall_s']:.1f} s (exit {train['rc']})", flush=True)
    if train["rc"] != 0:
        _write(res, args)
        return 1
    tok_dir = work / "out" / "train-tokenizer" / "tokenizer"

    # 2 and 3, in rounds: the tokenizer alone (one fresh process per method), then every prepare
    methods = tokenizer_methods()
    passes: list[dict] = []
    timed: dict[tuple[int, int], list[dict]] = {}
    for k in range(args.rounds):
        for method in (methods if k % 2 == 0 else methods[::-1]):
            t = tokenize_pass(tok_dir, one, args.batch, method)
            passes.append(t)
            print(f"round {k + 1}: tokenizer alone {method}: {t['seconds']:.2f} s, "
                  f"{t['text_bytes'] / 1e6 / t['seconds']:.2f} MB/s (other CPU {t['other_cpu_s']:.1f} s)",
                  flush=True)
        for n in sizes:
            c = corpora[n]
            for w in workers:
                r = run_prepare(f"jsonl:{Path(c['dir']) / 'corpus.jsonl'}", work / "out" / f"{n}x-w{w}", args,
                                workers=w, tokenizer=tok_dir, log=logs / f"{n}x-w{w}.log")
                r.update(size=n, workers=w, text_bytes=c["text_bytes"], units=log_units(r["log"]),
                         mb_per_s=c["text_bytes"] / 1e6 / r["wall_s"], docs_per_s=c["docs"] / r["wall_s"])
                timed.setdefault((n, w), []).append(r)
                print(f"round {k + 1}: {n}x --workers {w}: {r['wall_s']:.2f} s, {r['mb_per_s']:.2f} MB/s, "
                      f"peak RSS {r['peak_rss'] / 2**20:,.0f} MiB, other CPU {r['other_cpu_s']:.1f} s "
                      f"(exit {r['rc']})",
                      flush=True)
                if r["rc"] != 0:
                    break
    tok = res["tokenizer_alone"] = tokenizer_summary(passes, args.batch)
    # + one EOS per document, as the manifest counts
    alone = tok["methods"][tok["best"]]["tokens"] + tok["docs"]
    res["tokens_check"] = {"prepare": train.get("tokens"), "tokenizer_alone_plus_eos": alone,
                           "result": "MATCH" if train.get("tokens") == alone else "MISMATCH"}
    by = {key: best_of(rs) for key, rs in timed.items()}
    res["runs"] = [by[key] for key in sorted(by)]
    failed = any(r["rc"] != 0 for r in res["runs"])

    ceiling = tok["methods"][tok["best"]]["mb_per_s"]
    ok = {key: r for key, r in by.items() if r["rc"] == 0}
    for n in sizes:
        if (n, 1) in ok and (n, 2) in ok:
            v = ok[n, 2]["mb_per_s"] / ok[n, 1]["mb_per_s"]
            res["checks"].append({"name": f"{n}x: workers 2 / workers 1 (MB/s)", "value": v, "op": ">=",
                                  "target": TARGET_SPEEDUP_2, "result": verdict(v >= TARGET_SPEEDUP_2)})
        if (n, 1) in ok:
            v = ok[n, 1]["mb_per_s"] / ceiling
            res["checks"].append({"name": f"{n}x: workers 1 / tokenizer alone `{tok['best']}` (MB/s)",
                                  "value": v, "op": ">=", "target": TARGET_VS_TOKENIZER,
                                  "result": verdict(v >= TARGET_VS_TOKENIZER)})
    for w in workers:
        if big > 1 and (1, w) in ok and (big, w) in ok:
            v = ok[big, w]["peak_rss"] / ok[1, w]["peak_rss"]
            res["checks"].append({"name": f"--workers {w}: peak RSS {big}x / 1x", "value": v, "op": "<=",
                                  "target": TARGET_MEMORY_GROWTH,
                                  "result": verdict(v <= TARGET_MEMORY_GROWTH)})
    for n in sizes:  # not a target: the output should not depend on the worker count
        if all((n, w) in ok for w in workers) and len(workers) > 1:
            res["identical"].append(compare(f"{n}x manifest splits, --workers {workers[0]} vs {workers[-1]}",
                                            ok[n, workers[0]], ok[n, workers[-1]], required=False))

    # 4. formats: the largest corpus as parquet and as .jsonl.zst (same records, same stem)
    fm = {}
    for fmt, path in formats.items():
        kind = "parquet" if fmt == "parquet" else "jsonl"
        r = run_prepare(f"{kind}:{path}", work / "out" / f"{big}x-{fmt}-w{wmax}", args, workers=wmax,
                        tokenizer=tok_dir, log=logs / f"{big}x-{fmt}.log")
        c = corpora[big]
        r.update(size=big, workers=wmax, format=fmt, file_bytes=path.stat().st_size,
                 text_bytes=c["text_bytes"], units=log_units(r["log"]),
                 mb_per_s=c["text_bytes"] / 1e6 / r["wall_s"], docs_per_s=c["docs"] / r["wall_s"])
        failed |= r["rc"] != 0
        fm[fmt] = r
        res["formats"].append(r)
        print(f"{big}x {fmt} --workers {wmax}: {r['wall_s']:.2f} s (exit {r['rc']}), "
              f"file {r['file_bytes'] / 1e6:.0f} MB", flush=True)
    if fm and all(r["rc"] == 0 for r in fm.values()):
        res["identical"].append(compare(f"{big}x manifest splits, parquet vs jsonl.zst", fm["parquet"],
                                        fm["jsonl.zst"], required=True))
        if (big, wmax) in ok:
            res["identical"].append(compare(f"{big}x manifest splits, jsonl vs parquet", ok[big, wmax],
                                            fm["parquet"], required=False))
    res["machine"]["load_after"] = machine()["load_before"]

    print("\n" + "\n".join(report(res)))
    _write(res, args)
    if failed:
        print("error: a prepare failed (see the logs above)", file=sys.stderr)
        return 1
    if any(c["required"] and c["result"] == "DIFFERENT" for c in res["identical"]):
        print("error: the parquet and jsonl.zst manifests differ", file=sys.stderr)
        return 1
    return 0


def _write(res: dict, args) -> None:
    if args.json:
        for r in [res.get("train_run", {}), *res["runs"], *res["formats"]]:
            if "manifest" in r:
                r["manifest"] = {"splits": splits_key(r["manifest"])}
        args.json.write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_tokenize":
        tokenize_alone_child(sys.argv[2:])
    else:
        sys.exit(main())
