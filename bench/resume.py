"""Resume cost of the training stream (not a test): what a resumed reader reads, and how long it takes, to get
back to its position at 10, 50 and 90% of an epoch, shards on disk and behind a local HTTP server; the size of
a slot's saved position; and the stream's docs/s through 2 DataLoader workers.

    python bench/resume.py --corpus /tmp/bench_resume               # writes the corpus the first time
    python bench/resume.py --corpus /tmp/bench_resume --code DIR    # the same with the packtrain code in DIR
                                                                    # (e.g. `git archive` of an older commit)
    python bench/resume.py --corpus /tmp/bench_resume --json out.json

The corpus: --shards shards of --docs-per-shard synthetic documents (lognormal lengths, median ~1.6 kB) and a
word-level tokenizer. One reader (one rank, no workers: the numbers are per slot) goes through the epoch and
its DocumentLoader state is taken at each fraction; a fresh loader loads it, through torch.save and
load(weights_only=True) as a checkpoint would, and the time to its first document is the resume time (the
restore plus one chunk of --chunk-docs documents). Samples and bytes read in that window are counted at the
shard streams (webdataset's gopen, patched here), the same way for any code; the first document is checked
against the uninterrupted order. HTTP: the standard library's server in a thread of this process, read by
curl.

Throughput: one epoch over the first --tp-shards shards through DocumentLoader(num_workers=2), docs/s, for the
code as it is and (new code only) a stream that sends the whole shuffle buffer with every chunk instead of the
changes: the alternative the delta design avoids. Sizes: per slot, the saved position (torch.save bytes) as
implemented (samples of earlier shards + references into the current shard), as samples only, as references
only; and the pickled size of one chunk's state message (changes vs whole buffer).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import io
import json
import pickle
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

WORDS = [w for w in (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no will more about can said up "
    "them some could into what other time than then only its two may these like first new also after any "
    "where through resume shard buffer epoch sample reader stream position token packing document checkpoint"
).split()] + ["caf\u00e9", "na\u00efve", "\u03bb", "\u65e5\u672c"]


def make_corpus(root: Path, shards: int, docs_per_shard: int, seed: int = 0) -> None:
    """train-000000.tar ... (one `txt` per sample) and tokenizer/tokenizer.json (word level), unless
    present."""
    import tokenizers
    import webdataset as wds

    from trainer.data.tokenizer import SPECIAL_TOKENS

    if (root / "DONE").is_file():
        return
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for s in range(shards):
        with wds.TarWriter(str(root / f"train-{s:06d}.tar"), encoder=False, mtime=0) as sink:
            for m in range(docs_per_shard):
                n = int(np.clip(rng.lognormal(np.log(300), 0.8), 5, 8000))
                sink.write({"__key__": f"d{s:06d}_{m:05d}", "txt": " ".join(rng.choice(WORDS, n)).encode()})
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, "[UNK]", *WORDS])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    (root / "tokenizer").mkdir(exist_ok=True)
    tok.save(str(root / "tokenizer" / "tokenizer.json"))
    (root / "DONE").write_text("")


class Counted:
    """A shard stream (file, or webdataset's Pipe around curl) counting the bytes read from it."""

    totals = {"bytes": 0, "samples": 0}

    def __init__(self, stream) -> None:
        self._stream = stream

    def read(self, *args):
        data = self._stream.read(*args)
        Counted.totals["bytes"] += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self._stream, name)


def patch_counters() -> None:
    """Count, for whatever packtrain code is imported, the bytes of every shard stream and the samples
    read."""
    from trainer.data import sources, stream

    gopen = sources.gopen
    sources.gopen = lambda url, *a, **kw: Counted(gopen(url, *a, **kw))
    read_shard = stream.read_shard

    def counted_read_shard(*args, **kw):
        for sample in read_shard(*args, **kw):
            Counted.totals["samples"] += 1
            yield sample

    stream.read_shard = counted_read_shard


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


class QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        pass  # a reader that stops early (the end of a resume's window) resets its connection


def serve(directory: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    srv = QuietServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(directory)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def checkpointed(state: dict) -> dict:
    """`state` as a resumed run loads it (trainer.checkpoint.safe_io: torch.save, then load with
    weights_only=True)."""
    import torch

    from trainer.checkpoint.safe_io import decode, encode

    buf = io.BytesIO()
    torch.save(encode(state), buf)
    buf.seek(0)
    return decode(torch.load(buf, weights_only=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--code", type=Path, help="import packtrain from this directory (default: this checkout)")
    p.add_argument("--shards", type=int, default=128)
    p.add_argument("--docs-per-shard", type=int, default=200)
    p.add_argument("--buffer", type=int, default=1000,
                   help="shuffle buffer (the default of data.shuffle_buffer)")
    p.add_argument("--chunk-docs", type=int, default=64)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--repeats", type=int, default=3, help="resumes per case; the median time is reported")
    p.add_argument("--tp-shards", type=int, default=32)
    p.add_argument("--tp-repeats", type=int, default=3)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--throughput-only", action="store_true",
                   help="only the docs/s table: alternate runs with and without --code to compare code "
                        "versions")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.code:
        sys.path.insert(0, str(args.code.resolve()))
    import trainer
    from trainer.data.loader import DocumentLoader
    from trainer.data.stream import DocumentStream

    print(f"packtrain from {Path(trainer.__file__).parent.parent}")
    make_corpus(args.corpus, args.shards, args.docs_per_shard)
    patch_counters()
    disk = sorted(str(p) for p in args.corpus.glob("train-*.tar"))
    srv, base = serve(args.corpus)
    urls = [f"{base}/{Path(p).name}" for p in disk]
    tok_dir = args.corpus / "tokenizer"
    new_code = hasattr(DocumentLoader, "start")

    def stream(shards, cls=DocumentStream, **kw):
        return cls(shards, tok_dir, 0, seed=0, shuffle_buffer=args.buffer, chunk_docs=args.chunk_docs,
                   epochs=1, **kw)

    results = {"code": str(Path(trainer.__file__).parent.parent), "new_code": new_code, "resume": [],
               "sizes": [], "throughput": []}
    if args.throughput_only:
        srv.shutdown()
        results["throughput"] = throughput(stream, disk[: args.tp_shards], args, new_code)
        print_tables(results)
        return

    # -- the states at each fraction, from one pass over the epoch --------------------------------
    epoch_docs = args.shards * args.docs_per_shard
    stops = {f: int(f * epoch_docs) for f in args.fractions}
    states, mirrors, order = {}, {}, []
    loader = DocumentLoader(stream(disk))
    for doc in loader:
        order.append(doc.key)
        for f, k in stops.items():
            if len(order) == k:
                states[f] = loader.state_dict()
                if new_code:  # the main process's copy of the buffer, every sample with its text
                    position = loader.slot_states[0].position
                    mirrors[f] = (loader.slot_states[0], list(position.buffer))
    assert len(order) == epoch_docs, len(order)

    for where, shards in (("disk", disk), ("http", urls)):
        for f in args.fractions:
            times, reads = [], []
            pending = len(states[f]["pending"])  # the rest of the last chunk: in the state, read by no one
            for _ in range(args.repeats):
                resumed = DocumentLoader(stream(shards))
                resumed.load_state_dict(checkpointed(states[f]))
                Counted.totals.update(bytes=0, samples=0)
                t0 = time.perf_counter()
                docs = iter(resumed)
                for _ in range(pending + 1):  # up to the first document of a new chunk
                    first = next(docs)
                times.append(time.perf_counter() - t0)
                assert first.key == order[stops[f] + pending], (first.key, order[stops[f] + pending])
                reads.append(dict(Counted.totals))
                own = resumed.restore_read.get(0) if new_code else None
            row = {"where": where, "fraction": f, "position": stops[f], "time_s": statistics.median(times),
                   "samples_read": reads[-1]["samples"], "bytes_read": reads[-1]["bytes"],
                   "reported_samples": own[0] if own else None, "reported_bytes": own[1] if own else None}
            results["resume"].append(row)
            print(json.dumps(row))
    srv.shutdown()

    if new_code:
        results["sizes"] = position_sizes(mirrors, args)
    if not args.skip_throughput:
        results["throughput"] = throughput(stream, disk[: args.tp_shards], args, new_code)
    print_tables(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def position_sizes(mirrors: dict, args) -> list[dict]:
    """Bytes of one slot's saved position (torch.save), three ways, and of one chunk's state message."""
    import dataclasses

    import torch

    from trainer.data.reader import ReadPosition

    def saved_bytes(obj) -> int:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.tell()

    rows = []
    for f, (slot, buffer) in mirrors.items():
        pos = dataclasses.replace(slot.position, buffer=buffer)
        # as samples only: every item with its text (no references), as references only: no text at all
        as_samples = dataclasses.replace(pos, shard_index=-1).to_dict()
        as_samples["shard_index"] = pos.shard_index
        as_refs = pos.to_dict()
        as_refs["buffer"] = [[s, m, "", None] for s, m, _, _ in pos.buffer]
        current = sum(1 for s, m, _, _ in pos.buffer if s == pos.shard_index and m >= 0)
        whole_message = dataclasses.replace(slot, position=dataclasses.replace(
            pos, buffer=None, changes=(len(pos.buffer), dict(enumerate(pos.buffer)))))
        delta_message = dataclasses.replace(slot, position=dataclasses.replace(
            pos, buffer=None, changes=(len(pos.buffer),
                                       {i: pos.buffer[i]
                                        for i in range(min(args.chunk_docs, len(pos.buffer)))})))
        rows.append({
            "fraction": f, "buffered": len(pos.buffer), "of_current_shard": current,
            "implemented_bytes": saved_bytes(pos.to_dict()), "samples_only_bytes": saved_bytes(as_samples),
            "refs_only_bytes": saved_bytes(as_refs), "rng_bytes": saved_bytes(list(pos.rng[1])),
            "chunk_message_delta_bytes": len(pickle.dumps(delta_message)),
            "chunk_message_whole_buffer_bytes": len(pickle.dumps(whole_message)),
            "chunk_message_delta_ms": pickle_ms(delta_message),
            "chunk_message_whole_buffer_ms": pickle_ms(whole_message),
        })
        assert isinstance(ReadPosition.from_dict(pos.to_dict()), ReadPosition)
    return rows


def pickle_ms(obj, repeats: int = 20) -> float:
    """Median milliseconds of pickle.dumps + loads: what a chunk's state costs on its way through the worker
    queue (besides copying the bytes through shared memory)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pickle.loads(pickle.dumps(obj))
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def throughput(stream, shards: list[str], args, new_code: bool) -> list[dict]:
    """docs/s of one epoch over `shards` through DocumentLoader(num_workers=2), variants interleaved; and the
    CPU seconds per 1,000 documents, this process and its (joined) workers together: less at the mercy of
    other jobs on a shared machine than the wall time."""
    from trainer.data.loader import DocumentLoader
    from trainer.data.stream import DocumentStream

    variants = {"as is": DocumentStream}
    if new_code:
        variants["whole buffer per chunk"] = WholeBufferStream()
    speeds: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.tp_repeats):
        for name, cls in variants.items():
            c0, t0 = cpu_seconds(), time.perf_counter()
            n = sum(1 for _ in DocumentLoader(stream(shards, cls=cls), num_workers=2))
            speeds[name].append(n / (time.perf_counter() - t0))
            cpu[name].append(1000 * (cpu_seconds() - c0) / n)
    return [{"variant": name, "docs_per_s": statistics.median(v), "runs": v, "docs": n,
             "cpu_s_per_1000_docs": statistics.median(cpu[name])} for name, v in speeds.items()]


def cpu_seconds() -> float:
    """User + system CPU of this process and of its children that were waited for."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def WholeBufferStream():  # noqa: N802 (a class made on demand: the old code has no _snapshot to override)
    from trainer.data.stream import DocumentStream

    class Whole(DocumentStream):
        """Sends the whole shuffle buffer with every chunk (the alternative to sending the changes)."""

        def _snapshot(self, state, reader, restore_read=None):
            snap = super()._snapshot(state, reader, restore_read)
            if reader is not None:
                items = reader.buffer.items
                snap.position.changes = (len(items), dict(enumerate(items)))
            return snap

    return Whole


def print_tables(results: dict) -> None:
    print(f"\ncode: {results['code']}")
    print("\n| shards | position | resume s | samples read | bytes read | reported (samples / bytes) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results["resume"]:
        reported = ("-" if r["reported_samples"] is None
                    else f"{r['reported_samples']:,} / {r['reported_bytes']:,}")
        print(f"| {r['where']} | {r['fraction']:.0%} (doc {r['position']:,}) | {r['time_s']:.3f} | "
              f"{r['samples_read']:,} | {r['bytes_read']:,} | {reported} |")
    if results["sizes"]:
        print("\n| position | buffered (of current shard) | saved as implemented | samples only | refs only "
              "| rng | chunk message: changes | whole buffer |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in results["sizes"]:
            print(f"| {r['fraction']:.0%} | {r['buffered']} ({r['of_current_shard']}) | "
                  f"{r['implemented_bytes']:,} | "
                  f"{r['samples_only_bytes']:,} | {r['refs_only_bytes']:,} | {r['rng_bytes']:,} | "
                  f"{r['chunk_message_delta_bytes']:,} ({r['chunk_message_delta_ms']:.2f} ms) | "
                  f"{r['chunk_message_whole_buffer_bytes']:,} "
                  f"({r['chunk_message_whole_buffer_ms']:.2f} ms) |")
    if results["throughput"]:
        print("\n| stream (2 workers) | docs/s (median) | runs | CPU s / 1,000 docs |")
        print("|---|---:|---|---:|")
        for r in results["throughput"]:
            print(f"| {r['variant']} | {r['docs_per_s']:,.0f} | "
                  f"{', '.join(f'{x:,.0f}' for x in r['runs'])} | "
                  f"{r['cpu_s_per_1000_docs']:.3f} |")


if __name__ == "__main__":
    main()
