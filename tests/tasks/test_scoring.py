"""trainer.tasks.scoring and trainer.tasks.metrics on a tiny model built here.

The reference is plain PyTorch written in the test: each query + choice alone, one full forward, log_softmax,
gather of the choice's tokens. Packed rows (several sequences a row, several micro-batches, each attention
backend that runs on the CPU) and unpacked rows must give the same log-likelihoods to 1e-5 (fp32); a model
trained here to memorize three sentences must pick each of them (acc 1.0, greedy match on every item).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.harness import require_module, run_distributed
from tests.helpers import LLAMA3, MODEL, PAD, SEQ_LEN, hf_tokenizer_dir
from trainer.data.tokenizer import FramedTokenizer
from trainer.distributed.groups import DistInfo
from trainer.model import GPT, AttentionConfig
from trainer.model.attention import BackendUnavailable, TreeSegments
from trainer.tasks.metrics import first_best, item_records, mean_stderr, task_metrics
from trainer.tasks.scoring import Candidate, score, task_sequences, trees_of
from trainer.tasks.tasks import LANGUAGE_MODELING, MULTIPLE_CHOICE, Item, Task, TaskFileError

TOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model(backend: str = "sdpa_docs", seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(MODEL, AttentionConfig(backend=backend, flex_compile=False)).eval()


def random_candidates(n: int, seed: int = 0) -> list[Candidate]:
    """Queries of 1..12 tokens, choices of 1..10 (ids 2..V-1: never the pad id 1)."""
    rng = np.random.default_rng(seed)
    return [Candidate(tuple(int(t) for t in rng.integers(2, MODEL.vocab_size, size=rng.integers(1, 13))),
                      tuple(int(t) for t in rng.integers(2, MODEL.vocab_size, size=rng.integers(1, 11))))
            for _ in range(n)]


@torch.no_grad()
def reference(model: GPT, cand: Candidate) -> tuple[float, bool]:
    """The choice's log-likelihood and greedy match, from one forward of query + choice alone."""
    ids = torch.tensor([cand.query + cand.choice])
    logprobs = F.log_softmax(model(ids).logits[0].float(), dim=-1)  # (n, V)
    start = len(cand.query) - 1  # the position predicting the choice's first token
    targets = ids[0, start + 1:]
    picked = logprobs[start:-1].gather(1, targets[:, None]).squeeze(1)
    # summed as scored
    return float(picked.double().sum()), bool((logprobs[start:-1].argmax(-1) == targets).all())


@pytest.mark.parametrize("backend", ["sdpa_docs", "dense"])  # flex: its CPU forward takes ~3 s
def test_packed_and_unpacked_equal_each_sequence_scored_alone(backend):
    model = tiny_model(backend)
    cands = random_candidates(40)
    ref = [reference(model, c) for c in cands]
    # 2 rows a forward: many micro-batches
    packed = score(model, cands, "packed", PAD, batch_tokens=2 * SEQ_LEN)
    unpacked = score(model, cands, "unpacked", PAD, batch_tokens=2 * SEQ_LEN)
    want = np.array([r[0] for r in ref])
    assert np.abs(np.array(packed.loglikelihoods) - want).max() <= TOL
    assert np.abs(np.array(unpacked.loglikelihoods) - want).max() <= TOL
    assert packed.greedy == unpacked.greedy == [r[1] for r in ref]


def test_packed_rows_do_hold_several_sequences():
    """The packed path is exercised, not one sequence a row: 40 sequences of <= 22 tokens in rows of 32."""
    from trainer.data.feed import eval_batches

    docs = [c.document(i) for i, c in enumerate(random_candidates(40))]
    batches = eval_batches(docs, 0, 1, SEQ_LEN, "packed", 2 * SEQ_LEN, PAD)
    assert sum(b.num_docs for b in batches) == 40 and sum(b.shape[0] for b in batches) < 40


def test_packed_scoring_refuses_a_model_whose_documents_see_each_other():
    model = tiny_model()
    model.attention.isolate_documents = False
    with pytest.raises(ValueError, match="isolate_documents"):
        score(model, random_candidates(2), "packed", PAD, batch_tokens=SEQ_LEN)


def _score_on_rank(rank: int, world_size: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    info = DistInfo(rank, world_size, 0, torch.device("cpu"))  # the spawned world's: one data rank each
    return {layout: score(tiny_model(), cands, layout, PAD, SEQ_LEN, info=info).loglikelihoods
            for layout, cands in (("packed", random_candidates(9)), ("tree", items(5)))}


def test_two_ranks_split_the_items_and_gather_the_same_scores():
    """Packed and tree: each rank scores its share (trees whole), the all-reduce gives both ranks every
    score."""
    results = run_distributed(_score_on_rank, world_size=2)
    assert results[0] == results[1]
    alone = score(tiny_model(), random_candidates(9), "packed", PAD, SEQ_LEN).loglikelihoods
    assert np.abs(np.array(results[0]["packed"]) - np.array(alone)).max() <= TOL
    alone = score(tiny_model(), items(5), "packed", PAD, SEQ_LEN).loglikelihoods
    assert np.abs(np.array(results[0]["tree"]) - np.array(alone)).max() <= TREE_TOL


# ---------------------------------------------------------------------------------------------------
# The tree layout: an item's query once, its choices as branches (issue 57)
# ---------------------------------------------------------------------------------------------------

TREE_TOL = 4e-6


def items(n: int, seed: int = 0, query: tuple[int, int] = (1, 13), choices: int = 4,
          shared_prefix: int = 0) -> list[Candidate]:
    """`n` items of `choices` candidates sharing one query (query lengths in [query), choices of 1..6 tokens
    after `shared_prefix` tokens that every choice of the item starts with)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        q = tuple(int(t) for t in rng.integers(2, MODEL.vocab_size, size=rng.integers(*query)))
        prefix = tuple(int(t) for t in rng.integers(2, MODEL.vocab_size, size=shared_prefix))
        out += [Candidate(q, prefix + tuple(int(t) for t in rng.integers(2, MODEL.vocab_size,
                                                                         size=rng.integers(1, 7))))
                for _ in range(choices)]
    return out


TREE_CASES = {
    "short items": items(12),
    # query + 4 choices > SEQ_LEN: an item over several trees
    "long contexts": items(6, seed=1, query=(18, 25)),
    "shared prefixes": items(8, seed=2, shared_prefix=3),
    # interleaved
    "unordered": [c for pair in zip(items(4, seed=3), items(4, seed=4), strict=True) for c in pair],
}


@pytest.mark.parametrize("backend", ["sdpa_docs", "dense"])
@pytest.mark.parametrize("case", list(TREE_CASES))
def test_the_tree_layout_equals_packed_and_each_choice_alone(backend, case):
    """Per-choice log-likelihoods and greedy matches of the tree layout: the packed layout's and each (query +
    choice) alone in plain PyTorch, to 4e-6; several trees a row, several rows a forward."""
    model = tiny_model(backend)
    cands = TREE_CASES[case]
    tree = score(model, cands, "tree", PAD, batch_tokens=2 * SEQ_LEN)
    packed = score(model, cands, "packed", PAD, batch_tokens=2 * SEQ_LEN)
    ref = [reference(model, c) for c in cands]
    assert np.abs(np.array(tree.loglikelihoods) - np.array([r[0] for r in ref])).max() <= TREE_TOL
    assert np.abs(np.array(tree.loglikelihoods) - np.array(packed.loglikelihoods)).max() <= TREE_TOL
    assert tree.greedy == packed.greedy == [r[1] for r in ref]


def test_the_tree_layout_on_a_llama_model_with_rope_and_grouped_heads():
    """RoPE reads the branch positions (continuing from the query's end) as it reads positions alone."""
    from dataclasses import replace

    torch.manual_seed(0)
    llama = replace(MODEL, pos_emb="rope", norm="rmsnorm", mlp="swiglu", mlp_hidden=48, bias=False,
                    n_kv_head=1, tie_embeddings=False)
    model = GPT(llama, AttentionConfig(backend="sdpa_docs")).eval()
    cands = TREE_CASES["shared prefixes"]
    ref = [reference(model, c) for c in cands]
    tree = score(model, cands, "tree", PAD, SEQ_LEN)
    assert np.abs(np.array(tree.loglikelihoods) - np.array([r[0] for r in ref])).max() <= TREE_TOL
    assert tree.greedy == [r[1] for r in ref]


def test_the_tree_layout_on_flex():
    model = tiny_model("flex")
    cands = items(3, seed=5)
    ref = [reference(model, c)[0] for c in cands]
    assert np.abs(np.array(score(model, cands, "tree", PAD, SEQ_LEN).loglikelihoods) - ref).max() <= TREE_TOL


def test_the_trees_share_each_query_once_and_split_only_what_does_not_fit():
    cands = TREE_CASES["long contexts"] + TREE_CASES["unordered"]
    trees = trees_of(cands, SEQ_LEN)
    assert sorted(m for _, members in trees for m in members) == list(range(len(cands)))
    assert all(len(tree) <= SEQ_LEN for tree, _ in trees)
    assert all(all(cands[m].query == tuple(tree.trunk) for m in members) for tree, members in trees)
    short = trees_of(TREE_CASES["short items"], SEQ_LEN)
    assert len(short) == 12  # 4 choices of an item in one tree each: the query computed once, not 4 times
    forward = sum(len(tree) for tree, _ in short)
    assert forward < sum(len(c.query) + len(c.choice) for c in TREE_CASES["short items"])


def test_changing_one_choice_moves_no_sibling_and_the_probe_sees_a_leak(monkeypatch):
    """The leakage probe: one choice's tokens changed, its siblings' log-likelihoods do not move (its own
    does). With the branch condition dropped from the mask (every branch sees the branches before it), they
    do: the test can tell."""
    model = tiny_model("dense")
    cands = items(4, seed=6)
    changed = list(cands)
    changed[1] = Candidate(cands[1].query, tuple((t + 5) % MODEL.vocab_size or 2 for t in cands[1].choice))

    def moved() -> np.ndarray:
        a = np.array(score(model, cands, "tree", PAD, SEQ_LEN).loglikelihoods)
        b = np.array(score(model, changed, "tree", PAD, SEQ_LEN).loglikelihoods)
        return np.abs(a - b)

    delta = moved()
    assert delta[1] > 1e-3 and np.delete(delta, 1).max() <= 1e-6
    monkeypatch.setattr(TreeSegments, "dense_mask", lambda self, device: self.segments.dense_mask(device))
    leaky = moved()
    assert leaky[2] > 1e-4 or leaky[3] > 1e-4  # a later sibling of choice 1 now reads it


def test_a_varlen_kernel_is_refused_for_trees_naming_the_kernels_that_work():
    model = tiny_model()
    model.attention.backend = "flash"
    with pytest.raises(BackendUnavailable, match="cannot score the tree layout.*sdpa_docs, dense, flex"):
        score(model, items(1), "tree", PAD, SEQ_LEN)


# ---------------------------------------------------------------------------------------------------
# Accuracy on items whose answer is known
# ---------------------------------------------------------------------------------------------------

ALPHABET = " abcdefghijklmnopqrstuvwxyz"
SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "birds fly over hills"]


def encode(text: str) -> list[int]:
    """A character tokenizer: ids 2.. for ' ', 'a', ..., 'z' (0 and 1 are EOS and pad, as in MODEL)."""
    return [ALPHABET.index(ch) + 2 for ch in text]


@pytest.fixture(scope="module")
def memorizer() -> GPT:
    """The tiny model, trained here until it has the three sentences by heart (~150 Adam steps)."""
    model = tiny_model()
    model.train()
    ids = [torch.tensor(encode(s)) for s in SENTENCES]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(150):
        loss = sum(F.cross_entropy(model(x[None]).logits[0, :-1], x[1:]) for x in ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.05 * len(ids)
    return model.eval()


@pytest.mark.parametrize("layout", ["packed", "unpacked", "tree"])
def test_a_model_that_memorized_the_sentences_picks_them(memorizer, layout):
    cut = 8
    mc = Task("memory", MULTIPLE_CHOICE, tuple(Item(s[:cut], tuple(t[cut:] for t in SENTENCES), gold=k)
                                              for k, s in enumerate(SENTENCES)))
    lm = Task("memory_lm", LANGUAGE_MODELING, tuple(Item(s[:cut], (s[cut:],), 0) for s in SENTENCES))
    for task, metric in ((mc, "acc_norm"), (lm, "loglikelihood")):
        scores = score(memorizer, task_sequences(task, encode, SEQ_LEN), layout, PAD, 4 * SEQ_LEN)
        metrics = task_metrics(task, item_records(task, scores.loglikelihoods, scores.greedy))
        assert metrics["acc"] == 1.0 and metrics["n"] == 3 and metrics[metric] is not None
        assert metrics["acc_stderr"] == 0.0
        assert 0 < metrics["bits_per_byte"] < 0.5  # by heart: well under a bit a character


def test_ties_go_to_the_lowest_index():
    assert first_best([-1.0, -1.0, -2.0]) == 0 and first_best([-3.0, -1.0, -1.0]) == 1
    task = Task("t", MULTIPLE_CHOICE, (Item("q", ("ab", "cd"), 0), Item("q", ("ab", "cd"), 1)))
    records = item_records(task, [-1.0, -1.0, -1.0, -1.0], [])
    assert [r["pred"] for r in records] == [0, 0]
    assert task_metrics(task, records)["acc"] == 0.5  # the first item's gold is 0: a hit; the second's is 1


def test_acc_norm_divides_by_the_choice_characters():
    """lm-eval's acc_norm: a long choice's summed log-likelihood is lower for its length alone."""
    task = Task("t", MULTIPLE_CHOICE, (Item("q", ("a", "abcdefghij"), 1),))
    records = item_records(task, [-2.0, -5.0], [])
    metrics = task_metrics(task, records)
    assert metrics["acc"] == 0.0 and metrics["acc_norm"] == 1.0  # -2 / 1 < -5 / 10
    assert metrics["bits_per_byte"] == pytest.approx(5.0 / (np.log(2) * 10))


def test_standard_error_is_the_sample_standard_error_of_the_mean():
    assert mean_stderr([1.0, 0.0, 1.0, 0.0]) == pytest.approx(np.std([1, 0, 1, 0], ddof=1) / 2)
    assert mean_stderr([1.0]) is None


def test_an_item_longer_than_the_context_is_named():
    task = Task("long", MULTIPLE_CHOICE, (Item("a" * 30, ("bcd",), 0, line=3),), source="long.jsonl")
    with pytest.raises(TaskFileError, match=r"long.jsonl:3: query \+ choice is 33 tokens, more than the "
                                            r"model's context \(32\)"):
        task_sequences(task, encode, SEQ_LEN)


def test_a_query_starts_as_the_tokenizers_training_documents_do(tmp_path):
    """Llama-3-like framing: BOS before the query (transformers' own encoding of it), nothing else; never
    scored."""
    require_module("transformers", "pip install -e '.[dev]'")
    from transformers import AutoTokenizer

    tok_dir = hf_tokenizer_dir(tmp_path, LLAMA3, eos=LLAMA3[1], bos=LLAMA3[0],
                               post_processor=f"{LLAMA3[0]} $A")
    tok, hf = FramedTokenizer.load(tok_dir), AutoTokenizer.from_pretrained(tok_dir)
    task = Task("t", MULTIPLE_CHOICE, (Item("the cat", (" sat", " mat"), 0),))
    (a, b) = task_sequences(task, tok.encode, SEQ_LEN, tok.ids.head)
    assert a.query == b.query == tuple(hf("the cat")["input_ids"]) and a.query[0] == tok.ids.bos
    assert a.choice == tuple(hf(" sat", add_special_tokens=False)["input_ids"])
    assert not a.document(0).loss_mask[: len(a.query)].any() and a.document(0).loss_mask[len(a.query):].all()
