"""Data mixtures (trainer.data.mixture): token shares by weight, epochs that end as data.mix_exhausted says,
exact resume, and the refusals.

The references never use Document.source or the trainer's reader: a document's source is named by its key
(tests.helpers.mixture_corpora: "short--<n>", "long--<n>"), and a source's documents are the `.txt` members of
its shards, listed with tarfile.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import (
    ROOT,
    SMALL,
    assert_one_error_line,
    doc_keys,
    epoch_chunks,
    metrics,
    mixture_corpora,
    run_train,
    sources_override,
    torchrun,
)
from trainer.data.config import DataConfig, PackingConfig
from trainer.data.loader import DocumentLoader
from trainer.data.mixture import Mixture, MixtureStateError
from trainer.data.pipeline import RowStream, micro_batches
from trainer.data.reader import DataStreamError
from trainer.data.reshape import ReshapeError
from trainer.data.sources import ShardSourceError, resolve_source
from trainer.data.state import StreamStateError
from trainer.data.stream import DocumentStream, manifest_tokens
from trainer.data.tokenizer import load_tokenizer, special_ids

SEQ_LEN = 128
ROWS_PER_STEP = 2


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[Path, Path]:
    """short: 160 documents of ~14k tokens in all; long: 160 of ~112k (4 shards each)."""
    return mixture_corpora(tmp_path_factory.mktemp("mixture"))


def source_of(key: str) -> str:
    """The source a chunk key names: trainer.prepare names samples by their source file ("short--17"); the
    mixture puts its source's name in front ("short/short--17#1"), checked here against that."""
    prefix, sample = key.split("/", 1)
    assert prefix == sample.split("--")[0], key
    return prefix


def sample_key(key: str) -> str:
    """The chunk key without the mixture's source prefix, as tests.helpers.epoch_chunks names it."""
    return key.split("/", 1)[1]


def chunks_of(data: Path) -> Counter:
    """Every chunk of `data`'s train split once, at SEQ_LEN (tests.helpers.epoch_chunks: tarfile +
    tokenizers)."""
    return epoch_chunks(data, SEQ_LEN)


def by_source(keys: Counter, name: str) -> Counter:
    """The chunks of source `name` among a mixture's `keys`, by their sample keys."""
    return Counter({sample_key(k): n for k, n in keys.items() if source_of(k) == name})


def source_rows(data: Path, index: int, workers: int = 0, rank: int = 0, world_size: int = 1) -> RowStream:
    """One source's row stream as trainer.data.feed.build_data makes it, in this process."""
    source = resolve_source(DataConfig(path=str(data)))
    eos = special_ids(load_tokenizer(source.tokenizer_dir)).eos
    stream = DocumentStream(source.train_urls, source.tokenizer_dir, eos, seed=index + 7, rank=rank,
                            world_size=world_size, shuffle_buffer=8, expected_docs=source.expected_docs,
                            shard_tokens=manifest_tokens(source.train_urls, source.manifest), name=data.name,
                            source=index)
    return RowStream(DocumentLoader(stream, num_workers=workers, lockstep=True), SEQ_LEN,
                     PackingConfig(buffer_size=16))


def mixture(corpora, weights, exhausted="stop", workers=0, rank=0, world_size=1) -> Mixture:
    """The mixture of (short, long) as build_data makes it, in this process."""
    sources = [source_rows(data, i, workers, rank, world_size) for i, data in enumerate(corpora)]
    return Mixture(sources, [d.name for d in corpora], weights, exhausted, lockstep=True)


def take_steps(rows: Mixture, steps: int) -> list[list[list]]:
    """`steps` steps of ROWS_PER_STEP rows each, one rank, lockstep (an epoch's end: the next epoch
    starts)."""
    out = []
    for _ in range(steps):
        if rows.exhausted:
            rows.next_epoch()
        step = rows.take(ROWS_PER_STEP)
        if not step:  # the epoch ended exactly here
            rows.next_epoch()
            step = rows.take(ROWS_PER_STEP)
        out.append(step)
    return out


def one_epoch(mix: Mixture) -> Counter:
    """The chunk keys of the rows of one lockstep epoch."""
    keys = Counter()
    while not mix.exhausted:
        for row in mix.take(8):
            keys.update(doc.key for doc in row)
    mix.next_epoch()
    assert keys
    return keys


@pytest.mark.parametrize("exhausted", ["stop", "restart"])
def test_a_mixture_of_0_7_and_0_3_holds_its_token_shares_over_200_steps(corpora, exhausted):
    """Shares of the trained tokens (the rows, what every layout lays out), by key: within 2 % of the weights
    over 200 steps, and within one row at every step; under stop they cross 2.5 epochs (short runs out at ~20k
    tokens)."""
    rows = mixture(corpora, [0.7, 0.3], exhausted)
    try:
        steps = take_steps(rows, 200)
    finally:
        rows.close()
    tokens = Counter()
    for step in steps:
        for row in step:
            for doc in row:
                tokens[source_of(doc.key)] += len(doc)
                assert ["short", "long"][doc.source] == source_of(doc.key)  # the tag the metrics use
        total = tokens["short"] + tokens["long"]
        assert abs(tokens["short"] - 0.7 * total) <= SEQ_LEN, tokens
    share = tokens["short"] / (tokens["short"] + tokens["long"])
    assert abs(share - 0.7) < 0.02, (share, tokens)
    # rows nearly full: the shares are of real work
    assert sum(tokens.values()) > 0.95 * 200 * ROWS_PER_STEP * SEQ_LEN


def test_rows_hold_one_source_each_and_the_layouts_lay_out_the_same_documents(corpora):
    rows = mixture(corpora, [0.5, 0.5])
    try:
        step = rows.take(8)
    finally:
        rows.close()
    assert all(len({source_of(doc.key) for doc in row}) == 1 for row in step)
    laid_out = {layout: sorted(key
                               for mb in micro_batches(step, PackingConfig(layout=layout), SEQ_LEN, 512, 0)
                               for key in mb.doc_keys) for layout in ("packed", "unpacked", "bucketed")}
    assert laid_out["packed"] == laid_out["unpacked"] == laid_out["bucketed"]


def test_stop_ends_the_epoch_when_the_first_source_runs_out_and_every_source_starts_a_new_pass(corpora):
    """short (0.7 of ~14k tokens) runs out first: epoch 0 holds each short chunk once and a part of long, none
    twice; epoch 1 again every short chunk once, and long from the start of a new pass (as long alone reads
    its pass 1), not where epoch 0 left it."""
    mix = mixture(corpora, [0.7, 0.3], "stop")
    epochs = [one_epoch(mix) for _ in range(2)]
    short, long = chunks_of(corpora[0]), chunks_of(corpora[1])
    for keys in epochs:
        assert by_source(keys, "short") == short
        long_read = by_source(keys, "long")
        assert set(long_read) < set(long) and max(long_read.values()) == 1
    alone = source_rows(corpora[1], 1)
    dropped = alone.abandon_epoch()
    assert dropped == 0  # nothing read yet
    first_rows = [doc.key for row in alone.take(len(epochs[1])) for doc in row]
    alone.close()
    assert set(by_source(epochs[1], "long")) == {sample_key(k)
                                                 for k in first_rows[: len(by_source(epochs[1], "long"))]}
    summary = mix.summary()
    mix.close()
    assert summary["short"]["passes"] == 2 and summary["short"]["passes_cut"] == 0
    assert (summary["long"]["passes"] == 0 and summary["long"]["passes_cut"] == 2
            and summary["long"]["docs_cut"] > 0)
    assert summary["short"]["docs"] == 2 * sum(short.values())


def test_restart_reads_a_source_again_until_every_source_was_read_through(corpora):
    """short at 0.3 (~14k tokens) runs out long before long at 0.7 (~112k): it is read again and again; the
    epoch ends when long is read through, with each long chunk exactly once."""
    mix = mixture(corpora, [0.3, 0.7], "restart")
    keys = one_epoch(mix)
    summary = mix.summary()
    mix.close()
    short, long = chunks_of(corpora[0]), chunks_of(corpora[1])
    assert by_source(keys, "long") == long
    passes = summary["short"]["passes"]
    assert passes >= 2
    short_read = by_source(keys, "short")
    assert set(short_read) == set(short)
    assert set(short_read.values()) <= {passes, passes + 1}  # whole passes, then a part of one more (cut)
    assert summary["short"]["passes_cut"] == 1


@pytest.mark.parametrize("exhausted, cuts", [("stop", [30, 100]), ("restart", [100])])
def test_a_resumed_mixture_continues_exactly(corpora, exhausted, cuts):
    """Real DataLoader workers (2 per source). The state is pickled at each cut (mid-epoch 0 and in epoch 1
    under stop; in short's second pass under restart), a new mixture loads it and continues: the rows of every
    step are the uninterrupted run's."""
    total = 130

    def keys(steps):
        return [[[d.key for d in row] for row in step] for step in steps]

    rows = mixture(corpora, [0.7, 0.3], exhausted, workers=2)
    try:
        expected = keys(take_steps(rows, total))
    finally:
        rows.close()
    got, done, state = [], 0, None
    for cut in [*cuts, total]:
        rows = mixture(corpora, [0.7, 0.3], exhausted, workers=2)
        try:
            if state is not None:
                rows.load_state_dict(pickle.loads(state))
            got += keys(take_steps(rows, cut - done))
            state = pickle.dumps(rows.state_dict())
        finally:
            rows.close()
        done = cut
    assert got == expected


def test_rows_put_back_come_out_again_first(corpora):
    rows = mixture(corpora, [0.5, 0.5])
    try:
        first = rows.take(3)
        rows.unread(first)
        assert not rows.exhausted
        state = rows.state_dict()
        again = rows.take(3)
    finally:
        rows.close()
    assert [[d.key for d in r] for r in again] == [[d.key for d in r] for r in first]
    assert len(state["ready"]) == 3  # a checkpoint taken before the step ran holds them


def test_a_mixture_state_is_refused_where_it_does_not_fit(corpora):
    rows = mixture(corpora, [0.5, 0.5])
    try:
        take_steps(rows, 3)
        state = rows.state_dict()
    finally:
        rows.close()
    single = source_rows(corpora[0], 0)
    with pytest.raises(StreamStateError, match=r"the checkpoint's data stream mixes the sources "
                                           r"\['short', 'long'\]; this run reads one source"):
        single.reshaped_state([state, state], 1, lockstep=True)
    with pytest.raises(MixtureStateError, match=r"the checkpoint's data stream is one source"):
        mixture(corpora, [0.5, 0.5]).reshaped_state([single.state_dict()], 1, lockstep=True)
    with pytest.raises(ReshapeError, match=r"only with data.epoch_lockstep=true"):
        mixture(corpora, [0.5, 0.5]).reshaped_state([state, state], 1, lockstep=False)
    swapped = mixture(corpora[::-1], [0.5, 0.5])
    with pytest.raises(MixtureStateError, match=r"the checkpoint mixes the sources \['short', 'long'\]; "
                                                r"this run's data.sources names \['long', 'short'\]"):
        swapped.load_state_dict(state)
    single = source_rows(corpora[0], 0)
    try:
        single.take(1)
        with pytest.raises(MixtureStateError, match=r"the checkpoint's data stream is one source"):
            mixture(corpora, [0.5, 0.5]).load_state_dict(single.state_dict())
    finally:
        single.close()


def test_a_source_that_gives_no_document_is_an_error_naming_it(corpora, tmp_path):
    """Every sample of the long source is bad and skipped (on_error=skip): its first pass is empty."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for shard in sorted(corpora[1].glob("train-*.tar")):
        with tarfile.open(shard) as src, tarfile.open(bad / shard.name, "w") as dst:
            for member in src.getmembers():
                data = src.extractfile(member).read()
                member.name = member.name.replace(".txt", ".bin")  # no text field: a bad sample
                dst.addfile(member, io.BytesIO(data))
    source = resolve_source(DataConfig(urls=str(bad / "train-{000000..000003}.tar"),
                                       tokenizer=str(corpora[0] / "tokenizer")))
    eos = special_ids(load_tokenizer(source.tokenizer_dir)).eos
    stream = DocumentStream(source.train_urls, source.tokenizer_dir, eos, on_error="skip", name="long",
                            source=1)
    mix = mixture(corpora, [0.5, 0.5], "restart")
    mix.sources[1] = RowStream(DocumentLoader(stream, num_workers=0, lockstep=True), SEQ_LEN, PackingConfig())
    with pytest.raises(DataStreamError, match=r"source 'long': a whole pass over this rank's share of "
                                              r"its shards gave no document"):
        mix.take(4)
    mix.close()


def test_without_lockstep_the_mixture_runs_its_epochs_on(corpora):
    """data.epoch_lockstep=false: never exhausted; under stop the next epoch (new passes) follows at once."""
    mix = mixture(corpora, [0.7, 0.3], "stop")
    mix.lockstep = False
    seen = Counter()
    while mix.epoch < 2:
        assert not mix.exhausted
        for row in mix.take(1):
            if mix.epoch < 2:
                seen.update(sample_key(doc.key) for doc in row if source_of(doc.key) == "short")
    mix.close()
    assert Counter({k: 2 * n for k, n in chunks_of(corpora[0]).items()}) == seen  # two whole passes of short
    assert mix.summary()["long"]["passes_cut"] == 2


def test_a_source_with_fewer_shards_than_readers_is_named(corpora):
    mix = mixture(corpora, [0.5, 0.5], workers=0, rank=0, world_size=8)
    with pytest.raises(DataStreamError, match=r"source 'short': 4 shards cannot feed 8 readers"):
        mix.take(1)
    mix.close()


def test_a_source_without_training_shards_is_named(corpora):
    """A source whose prepared train split lists no shard (every document went to val): the error names it."""
    source = resolve_source(DataConfig(path=str(corpora[1])))
    with pytest.raises(DataStreamError, match=r"source 'long': no training shards to read"):
        DocumentStream([], source.tokenizer_dir, 0, name="long", source=1)


# -- real runs ------------------------------------------------------------------------------------------


def test_a_real_two_rank_mixture_run_resumes_exactly_and_on_another_shape(corpora, tmp_path):
    """torchrun, 2 ranks x 2 DataLoader workers per source, 0.7/0.3 stop (short runs out after ~20 steps on
    each rank, so an epoch ends and the lockstep wait runs): the epoch's accounting by source (over both
    ranks, by the metrics' epoch: every chunk of short once, none of long twice); 24 steps straight vs the
    same run resumed from its step-12 checkpoint -> the same losses; resumed from it on 1 rank and on 3 ranks
    (1 worker each) -> the same accounting of epoch 0 over both runs, the shares following the weights from
    the resume on, epoch 1 reached."""
    mix = sources_override(("short", corpora[0], 0.7), ("long", corpora[1], 0.3))
    # What the ranks read does not depend on the model: one block 16 wide (the tiny model's two 64 wide cost
    # more).
    common = [mix, "model.n_layer=1", "model.n_embd=16", "model.n_head=2", "train.eval_every=0",
              "train.checkpoint_every=12", "train.max_steps=24", "logging.record_doc_keys=true"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(straight, None, *common, "data.num_workers=2", launcher=torchrun(2))
    resumes = [(resumed, 2, ("data.num_workers=2",))]  # the same shape, then 1 and 3 ranks (1 worker each)
    # 4 shards of short over 3 readers: one new reader holds two rests, and the others wait for it
    resumes += [(tmp_path / f"on_{ranks}", ranks, ("data.num_workers=1", "train.max_steps=40"))
                for ranks in (1, 3)]
    for run, _, _ in resumes:
        shutil.copytree(straight, run)
        shutil.rmtree(run / "checkpoints" / "step_000024")
    # Independent runs in their own run dirs: side by side (a start is seconds of imports per rank).
    launchers = [torchrun(ranks) for _, ranks, _ in resumes]
    with ThreadPoolExecutor(len(resumes)) as pool:
        procs = list(pool.map(lambda item, launcher: run_train(item[0], None, *common, *item[2],
                                                               "train.resume=true", launcher=launcher),
                              resumes, launchers))
    a, b = metrics(straight), metrics(resumed)
    assert [m["step"] for m in b] == list(range(1, 25))
    assert max(m["epoch"] for m in a) >= 1  # an epoch boundary inside the run
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) < 1e-6, (x["step"], x["loss"], y["loss"])
    short_chunks = epoch_chunks(corpora[0], 128)
    long_chunks = epoch_chunks(corpora[1], 128)

    def check_epochs(runs: list[tuple[Path, int, int]]) -> None:
        """Every epoch but the last one of these runs' steps from..to: short's chunks once, long's at most
        once."""
        trained: dict[int, Counter] = {}
        for run, first, last in runs:
            epoch_of = {m["step"]: m["epoch"] for m in metrics(run)}
            for steps in doc_keys(run).values():
                for step, keys in steps.items():
                    if first <= step <= last:
                        trained.setdefault(epoch_of[step], Counter()).update(keys)
        assert len(trained) >= 2
        for epoch in range(max(trained)):  # the last one is cut by train.max_steps
            got = trained[epoch]
            assert by_source(got, "short") == short_chunks, epoch
            long_got = by_source(got, "long")
            assert set(long_got) < set(long_chunks) and max(long_got.values()) == 1, epoch

    check_epochs([(straight, 1, 24)])
    summary = json.loads((straight / "summary.json").read_text())
    assert set(summary["mixture"]) == {"short", "long"}
    for (run, ranks, _), proc in zip(resumes[1:], procs[1:], strict=True):
        assert ("resume on another shape: written by 2 rank(s) x 2 DataLoader worker(s), resumed on "
                f"{ranks} x 1: what was left of epoch 0 is dealt") in proc.stdout
        after = metrics(run)
        assert [m["step"] for m in after] == list(range(1, 41)) and after[-1]["epoch"] >= 1
        check_epochs([(straight, 1, 12), (run, 13, 40)])
        tokens = Counter()
        for m in after[12:16]:  # the first steps after the resume: no rank has run out of short yet
            tokens.update(m["tokens_by_source"])
        assert abs(tokens["short"] / (tokens["short"] + tokens["long"]) - 0.7) < 0.08, (ranks, tokens)


def test_a_mixture_of_sources_with_other_tokenizers_is_one_error_line(corpora, tmp_path):
    other = tmp_path / "other"
    (tmp_path / "o.jsonl").write_text("".join(json.dumps({"text": f"other words {i} " * 9}) + "\n"
                                              for i in range(80)))
    from trainer.prepare import prepare

    prepare(f"jsonl:{tmp_path / 'o.jsonl'}", other, vocab_size=300, docs_per_shard=20, val_fraction=0.0,
            seed=0)
    mix = sources_override(("short", corpora[0], 0.5), ("other", other, 0.5))
    proc = subprocess.run([sys.executable, "-m", "trainer.train", f"hydra.run.dir={tmp_path / 'run'}", *SMALL,
                           mix, "train.max_steps=1"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert_one_error_line(proc.returncode, proc.stderr, "source 'other' was prepared with another tokenizer",
                          str(other / "tokenizer"))



# -- a resume on another shape (Mixture.reshaped_state) ----------------------------------------------------


def take_tracked(mix: Mixture, limit: int | None = None) -> tuple[list[str], list[str]]:
    """Rows taken one at a time, up to `limit` (None: to the lockstep epoch's end): (the keys of rows of a
    source's pass of the epoch, the keys of rows of an extra pass begun after it was read through:
    restart)."""
    first, extra = [], []
    while (limit is None or limit > 0) and not mix.exhausted:
        rows = mix.take(1)
        if not rows:
            continue  # the epoch ended in this take
        s = mix.names.index(source_of(rows[0][0].key))
        (extra if mix.read_through[s] else first).extend(doc.key for doc in rows[0])
        limit = None if limit is None else limit - 1
    return first, extra


def old_states(corpora, weights, exhausted, takes, tmp_path) -> tuple[list[dict], Counter, Counter]:
    """2 ranks x 2 DataLoader workers, rank r taking takes[r] rows (None: to its epoch's end, then it waits);
    their states through safe_io (as a checkpoint holds them), the keys of the passes' rows and of extra
    ones."""
    from trainer.checkpoint.safe_io import load_state, save_state

    states, first, extra = [], Counter(), Counter()
    for rank, n in enumerate(takes):
        mix = mixture(corpora, weights, exhausted, workers=2, rank=rank, world_size=2)
        try:
            got = take_tracked(mix, n)
            states.append(mix.state_dict())
        finally:
            mix.close()
        first.update(got[0])
        extra.update(got[1])
    save_state(states, tmp_path / "states.pt")
    return load_state(tmp_path / "states.pt"), first, extra


RESHAPES = [  # (policy, weights, rows taken per old rank (None: to the epoch's end), new ranks x workers)
    ("stop", [0.7, 0.3], [40, 15], (3, 0)),
    ("stop", [0.7, 0.3], [None, 30], (3, 1)),  # rank 0 waits at the epoch's end: its long pass was cut
    ("stop", [0.7, 0.3], [None, 30], (1, 0)),
    ("restart", [0.3, 0.7], [260, 40], (3, 0)),  # rank 0 read short through and is in an extra pass of it
    ("restart", [0.3, 0.7], [260, 40], (1, 2)),
]


@pytest.mark.parametrize("exhausted, weights, takes, new", RESHAPES,
                         ids=[f"{e}-{t}-{n[0]}x{n[1]}" for e, _, t, n in RESHAPES])
def test_a_mixture_resumed_on_another_shape_trains_each_sources_rest_of_the_epoch_once(
        corpora, tmp_path, exhausted, weights, takes, new):
    """Each source's rows of the interrupted epoch, before the resume (2 x 2) and after it (the new shape,
    each rank to its epoch's end): every chunk of a source read through in the epoch exactly once (restart:
    both; stop: short), none of any source twice, apart from the rows of extra passes (restart); from the
    resume on, the shares follow the weights (within a row at every row, on every new rank: `mixed` starts
    at 0)."""
    states, first, extra = old_states(corpora, weights, exhausted, takes, tmp_path)
    if exhausted == "restart":
        assert extra, "an old rank should be in an extra pass of short"
    world, workers = new
    for rank in range(world):
        mix = mixture(corpora, weights, exhausted, workers=workers, rank=rank, world_size=world)
        try:
            mix.load_state(mix.reshaped_state(states, workers, lockstep=True))
            tokens = Counter()
            while not mix.exhausted:
                rows = mix.take(1)
                for row in rows:
                    s = mix.names.index(source_of(row[0].key))
                    (extra if mix.read_through[s] else first).update(doc.key for doc in row)
                    tokens[s] += sum(len(doc) for doc in row)
                    assert abs(tokens[0] - mix.weights[0] * sum(tokens.values())) <= SEQ_LEN, tokens
            assert mix.epoch == 1
        finally:
            mix.close()
    short, long = chunks_of(corpora[0]), chunks_of(corpora[1])
    assert by_source(first, "short") == short
    if exhausted == "restart":
        assert by_source(first, "long") == long
        assert set(by_source(extra, "short")) <= set(short) and not by_source(extra, "long")
    else:
        long_read = by_source(first, "long")
        assert set(long_read) < set(long) and max(long_read.values()) == 1
        assert not extra


def test_after_a_reshaped_epoch_each_source_starts_the_next_pass_of_the_new_shape(corpora, tmp_path):
    """stop: after the dealt rest of epoch 0, each source's first rows of epoch 1 on every new rank are those
    a mixture on the new shape from the start reads in its epoch 1 (the source's own pass 1, the new
    split)."""
    states, _, _ = old_states(corpora, [0.7, 0.3], "stop", [None, 30], tmp_path)
    for rank in range(3):
        per_source = []
        for reshaped in (True, False):
            mix = mixture(corpora, [0.7, 0.3], "stop", rank=rank, world_size=3)
            try:
                if reshaped:
                    mix.load_state(mix.reshaped_state(states, 0, lockstep=True))
                while not mix.exhausted:
                    mix.take(4)
                mix.next_epoch()
                got = {"short": [], "long": []}
                while min(map(len, got.values())) < 3:
                    row = mix.take(1)[0]
                    got[source_of(row[0].key)].append([doc.key for doc in row])
                per_source.append({name: keys[:3] for name, keys in got.items()})
            finally:
                mix.close()
        assert per_source[0] == per_source[1], rank


def test_a_mixture_state_of_ranks_in_different_epochs_is_refused(corpora, tmp_path):
    states, _, _ = old_states(corpora, [0.7, 0.3], "stop", [None, 30], tmp_path)
    states[1]["docs"]["mixture"]["epoch"] += 1
    mix = mixture(corpora, [0.7, 0.3], "stop", rank=0, world_size=3)
    try:
        with pytest.raises(ReshapeError, match=r"different mixture epochs \(\[0, 1\]\): not a lockstep run"):
            mix.reshaped_state(states, 0, lockstep=True)
    finally:
        mix.close()


def test_a_source_whose_path_and_urls_name_two_datasets_is_one_line_naming_both(corpora):
    """data.path of one dataset with data.urls of another (same shard names, other contents): refused at the
    start, naming the shard, its size and the manifest's, instead of every shard being read through and then
    reported as truncated. The same shards with their own manifest pass."""
    short, long = corpora
    with pytest.raises(ShardSourceError) as e:
        resolve_source(DataConfig(path=str(short), urls=f"{long}/train-*.tar"))
    size = (long / "train-000000.tar").stat().st_size
    listed = next(s["bytes"]
                  for s in json.loads((short / "manifest.json").read_text())["splits"]["train"]["shards"]
                  if s["name"] == "train-000000.tar")
    assert str(e.value) == (f"{long}/train-000000.tar is not the shard train-000000.tar of "
                            f"{short}/manifest.json ({size:,} bytes; the manifest lists {listed:,}): "
                            "data.path and data.urls name different datasets; "
                            "give data.path of the dataset these shards belong to, or leave data.path out")
    assert resolve_source(DataConfig(path=str(long), urls=f"{long}/train-*.tar")).expected_docs
