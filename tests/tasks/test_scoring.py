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
from trainer.model import GPT, AttentionConfig
from trainer.tasks.metrics import first_best, item_records, mean_stderr, task_metrics
from trainer.tasks.scoring import Candidate, score, task_sequences
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
    return float(picked.sum()), bool((logprobs[start:-1].argmax(-1) == targets).all())


@pytest.mark.parametrize("backend", ["sdpa_docs", "dense"])  # flex: its CPU forward takes ~3 s
def test_packed_and_unpacked_equal_each_sequence_scored_alone(backend):
    model = tiny_model(backend)
    cands = random_candidates(40)
    ref = [reference(model, c) for c in cands]
    packed = score(model, cands, "packed", PAD, batch_tokens=2 * SEQ_LEN)  # 2 rows a forward: many micro-batches
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


def _score_on_rank(rank: int, world_size: int) -> list[float]:
    torch.set_num_threads(1)
    return score(tiny_model(), random_candidates(9), "packed", PAD, SEQ_LEN, rank=rank,
                 world_size=world_size).loglikelihoods


def test_two_ranks_split_the_items_and_gather_the_same_scores():
    results = run_distributed(_score_on_rank, world_size=2)
    alone = score(tiny_model(), random_candidates(9), "packed", PAD, SEQ_LEN).loglikelihoods
    assert results[0] == results[1]
    assert np.abs(np.array(results[0]) - np.array(alone)).max() <= TOL


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


@pytest.mark.parametrize("layout", ["packed", "unpacked"])
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
    with pytest.raises(TaskFileError, match=r"long.jsonl:3: query \+ choice is 33 tokens, more than the model's "
                                            r"context \(32\)"):
        task_sequences(task, encode, SEQ_LEN)


def test_a_query_starts_as_the_tokenizers_training_documents_do(tmp_path):
    """Llama-3-like framing: BOS before the query (transformers' own encoding of it), nothing else; never scored."""
    require_module("transformers", "pip install -e '.[dev]'")
    from transformers import AutoTokenizer

    tok_dir = hf_tokenizer_dir(tmp_path, LLAMA3, eos=LLAMA3[1], bos=LLAMA3[0], post_processor=f"{LLAMA3[0]} $A")
    tok, hf = FramedTokenizer.load(tok_dir), AutoTokenizer.from_pretrained(tok_dir)
    task = Task("t", MULTIPLE_CHOICE, (Item("the cat", (" sat", " mat"), 0),))
    (a, b) = task_sequences(task, tok.encode, SEQ_LEN, tok.ids.head)
    assert a.query == b.query == tuple(hf("the cat")["input_ids"]) and a.query[0] == tok.ids.bos
    assert a.choice == tuple(hf(" sat", add_special_tokens=False)["input_ids"])
    assert not a.document(0).loss_mask[: len(a.query)].any() and a.document(0).loss_mask[len(a.query):].all()
