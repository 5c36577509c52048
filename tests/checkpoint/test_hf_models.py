"""Hugging Face models in and out (trainer.checkpoint.hf): GPT-2, Llama, Qwen2 and Mistral as packtrain's GPT.

The independent reference is `transformers` itself: tiny random models of each class are built inside the test
(no hub), every weight perturbed so that a swapped norm, a misplaced slice of the fused q|k|v or gate|up rows,
or a transposed matrix changes the logits. packtrain loads their directories (trainer.checkpoint.hf.load_hf),
packs several documents per row, and must give each document's logits and gradients as transformers gives them
on that document alone; exported back (trainer.export.write_hf), transformers loads the same class with the
same weights.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.harness import require_module
from tests.helpers import ENV, ROOT, GradientRecorder, assert_one_error_line, latest_checkpoint, run_train
from trainer.checkpoint import hf
from trainer.data.batch import Document, collate_rows
from trainer.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
from trainer.distributed.groups import DistInfo
from trainer.export import write_hf
from trainer.model import AttentionConfig, model_inputs
from trainer.run.step import train_step

VOCAB = 300
ROW = 48
DOC_LENS = ([9, 14, 6, 13], [17, 11, 20])  # two packed rows, each with a padding tail
TOL = 1e-5
KINDS = ("gpt2", "llama", "llama3_scaled", "qwen2", "qwen2_untied", "mistral")


@pytest.fixture(scope="module")
def transformers():
    return require_module("transformers", "pip install transformers")


def hf_config(transformers, kind: str):
    """A tiny config of each family: GQA (4 heads, 2 kv heads), an untied head for Llama, q/k/v biases for
    Qwen2, Mistral without its sliding window."""
    if kind == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    llama = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                 rope_theta=500.0)
    if kind == "llama":
        return transformers.LlamaConfig(**llama, tie_word_embeddings=False)
    if kind == "llama3_scaled":  # Llama-3.2's frequency scaling, at a context where all three bands occur
        scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16}
        return transformers.LlamaConfig(**llama, tie_word_embeddings=True, rope_scaling=scaling)
    if kind == "mistral":
        return transformers.MistralConfig(**llama, tie_word_embeddings=False, sliding_window=None)
    return transformers.Qwen2Config(**llama, tie_word_embeddings=kind == "qwen2")


@pytest.fixture(scope="module", params=KINDS)
def reference(request, transformers, tmp_path_factory):
    """(kind, transformers model in fp32 eval mode, its saved directory)."""
    torch.manual_seed(KINDS.index(request.param))
    model = transformers.AutoModelForCausalLM.from_config(hf_config(transformers, request.param),
                                                          attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms around 1, everything else spread out
            p.copy_((1.0 if name.endswith("norm.weight") or ".ln_" in name else 0.0)
                    + 0.08 * torch.randn_like(p))
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    return request.param, model, out


def documents(seed: int = 0) -> list[list[Document]]:
    rng = np.random.default_rng(seed)
    return [[Document(key=f"r{r}d{d}", tokens=rng.integers(4, VOCAB, size=n)) for d, n in enumerate(lens)]
            for r, lens in enumerate(DOC_LENS)]


def reference_logits(model, doc: Document) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.as_tensor(doc.tokens)[None]).logits[0]


@pytest.mark.parametrize("backend", ["sdpa_docs", "dense", "flex"])
def test_packed_logits_equal_transformers_on_each_document_alone(reference, backend):
    kind, ref, path = reference
    ours = hf.load_hf(path, attention=AttentionConfig(backend=backend, flex_compile=False))
    rows = documents()
    batch = collate_rows(rows, ROW, 0, "packed")
    with torch.no_grad():
        logits = ours(**model_inputs(batch), return_logits=True).logits
    worst = 0.0
    for r, row in enumerate(rows):
        start = 0
        for doc in row:
            theirs = reference_logits(ref, doc)
            mine = logits[r, start : start + len(doc)]
            worst = max(worst, (mine - theirs).abs().max().item())
            start += len(doc)
    print(f"{kind} {backend}: max |logit difference| {worst:.2e}")
    assert worst <= TOL


def test_gradients_of_a_packed_step_equal_transformers_summed_document_losses(reference):
    """One real train_step over the packed rows (normalized by the global target count) against d(sum of
    transformers' per-document summed losses / the same count): the loss and every parameter's gradient."""
    kind, ref, path = reference
    ours = hf.load_hf(path).train()
    rows = documents(1)
    batch = collate_rows(rows, ROW, 0, "packed")
    optimizer = torch.optim.SGD(ours.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    info = DistInfo(0, 1, 0, torch.device("cpu"))
    engine = GradientRecorder(ours, optimizer, scheduler, info, grad_clip=0.0, dtype="fp32")
    stats = train_step(engine, [batch], info, 0)
    grads = hf.to_hf(engine.grads, ours.cfg)

    ref.zero_grad(set_to_none=True)
    targets = sum(len(doc) - 1 for row in rows for doc in row)
    total = sum(ref(torch.as_tensor(doc.tokens)[None], labels=torch.as_tensor(doc.tokens)[None]).loss
                * (len(doc) - 1) for row in rows for doc in row)
    (total / targets).backward()
    assert abs(stats.loss - (total / targets).item()) <= TOL
    theirs = {n: p.grad for n, p in ref.named_parameters()}
    assert set(grads) == set(theirs), set(grads) ^ set(theirs)
    errors = {n: ((grads[n] - g).norm() / g.norm()).item() for n, g in theirs.items()}
    worst = max(errors, key=errors.get)
    print(f"{kind}: max relative gradient error {errors[worst]:.2e} ({worst})")
    assert errors[worst] <= TOL, errors
    ref.zero_grad(set_to_none=True)


def test_packed_and_unpacked_steps_give_the_same_loss_and_gradients(reference):
    kind, _, path = reference
    out = {}
    for layout in ("packed", "unpacked"):
        model = hf.load_hf(path).train()
        rows = documents(2)
        batch = collate_rows(rows if layout == "packed" else [[d] for row in rows for d in row], ROW, 0,
                             layout)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        info = DistInfo(0, 1, 0, torch.device("cpu"))
        engine = GradientRecorder(model, optimizer,
                                  torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), info,
                                  grad_clip=0.0, dtype="fp32")
        stats = train_step(engine, [batch], info, 0)
        out[layout] = stats.loss, engine.grads
    assert abs(out["packed"][0] - out["unpacked"][0]) <= 1e-6
    for name, g in out["packed"][1].items():
        assert (g - out["unpacked"][1][name]).abs().max() <= 1e-6, name


def test_greedy_decoding_with_the_kv_cache_equals_transformers_generate(reference):
    """trainer.generate's cache holds the kv heads (GQA: fewer than the query heads) and repeats them per
    step."""
    from trainer.generate import generate

    kind, ref, path = reference
    ours = hf.load_hf(path)
    prompt = documents()[0][0].tokens.tolist()
    mine = generate(ours, prompt, max_new_tokens=12)
    with torch.no_grad():
        theirs = ref.generate(torch.as_tensor(prompt)[None], max_new_tokens=12, min_new_tokens=12,
                              do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert mine == theirs and generate(ours, prompt, max_new_tokens=12, use_cache=False) == mine


def test_the_chunked_loss_reads_an_untied_head(reference):
    """loss.chunk_tokens computes the head a chunk at a time from lm_head.weight: an untied head's own
    weights."""
    kind, _, path = reference
    batch = collate_rows(documents(3), ROW, 0, "packed")
    out = {}
    for chunk in (0, 16):
        model = hf.load_hf(path).train()
        model.loss_chunk_tokens = chunk
        loss = model(**model_inputs(batch)).loss_sum
        loss.backward()
        out[chunk] = loss.item(), model.lm_head.weight.grad.clone()
    assert abs(out[0][0] - out[16][0]) <= 1e-5 * abs(out[0][0])
    assert (out[16][1] - out[0][1]).norm() <= 1e-5 * out[0][1].norm()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(["def parse(text): return text.split()"] * 20, vocab_size=VOCAB), out)
    assert load_tokenizer(out).get_vocab_size() <= VOCAB
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_gives_back_the_same_class_weights_and_logits(reference, transformers, tokenizer_dir, tmp_path,
                                                             dtype):
    kind, ref, path = reference
    ours = hf.load_hf(path)
    write_hf(ours, tokenizer_dir, tmp_path, dtype)
    config = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
    assert config["architectures"] == ref.config.architectures
    assert config["dtype"] == config["torch_dtype"] == str(dtype).removeprefix("torch.")
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True,
                                                                  attn_implementation="eager", dtype=dtype)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(back) is type(ref)
    from safetensors import safe_open

    with safe_open(str(tmp_path / hf.WEIGHTS_FILE), framework="pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(k).dtype == dtype for k in names)  # what config.json says, every tensor
    tied = ref.config.tie_word_embeddings
    assert ("lm_head.weight" in names) is (not tied)  # a tied head is written once, as the embedding
    theirs = dict(ref.named_parameters())
    for name, p in back.named_parameters():
        assert torch.equal(p, theirs[name].to(dtype)), name
    if dtype == torch.float32:
        doc = documents()[0][1]
        assert (reference_logits(back, doc) - reference_logits(ref, doc)).abs().max() == 0


# ---------------------------------------------------------------------------------------------------
# Real configs on the meta device, and what is refused
# ---------------------------------------------------------------------------------------------------

SMOLLM2_135M = {  # HuggingFaceTB/SmolLM2-135M config.json
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 576,
    "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536, "max_position_embeddings": 8192, "mlp_bias": False, "num_attention_heads": 9,
    "num_hidden_layers": 30, "num_key_value_heads": 3, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 49152}
QWEN25_05B = {  # Qwen/Qwen2.5-0.5B config.json
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896,
    "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
    "max_window_layers": 24, "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}


@pytest.mark.parametrize("config,about", [(SMOLLM2_135M, 134.5e6), (QWEN25_05B, 494.0e6)])
def test_real_configs_on_the_meta_device_have_transformers_shapes_and_counts(transformers, config, about):
    from trainer.model import GPT

    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
        ours = GPT(hf.config_from_hf(config, "config.json"))
    theirs = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    mapped = {piece.hf: tuple(hf._view(ours.state_dict()[piece.name], piece).shape)
              for piece in hf.pieces(ours.cfg)}
    assert mapped == theirs
    count = ours.num_params()
    assert count == sum(p.numel() for p in ref.parameters())
    assert abs(count - about) / about < 0.002, count


@pytest.mark.parametrize("change,needle", [
    ({"model_type": "gemma"}, "model_type 'gemma' is not supported; supported: GPT2LMHeadModel"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 4096},
     "mistral variant packtrain's GPT does not compute"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "is not a causal language model"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not supported"),
    ({"attention_bias": True}, "mlp_bias=False"),
    ({"head_dim": 128}, "head_dim=128"),
    ({"use_sliding_window": True}, "use_sliding_window=True"),
    # issue 54: -4 heads named head_dim; a string vocabulary size a TypeError deep inside the build
    ({"num_attention_heads": -4}, "config.json: num_attention_heads must be a positive integer, got -4"),
    ({"vocab_size": "49152"}, "config.json: vocab_size must be a positive integer, got '49152'"),
    ({"vocab_size": 49152.5}, "config.json: vocab_size must be a positive integer, got 49152.5"),
    ({"num_key_value_heads": 0}, "config.json: num_key_value_heads must be a positive integer, got 0"),
])
def test_unsupported_configs_are_one_line_naming_what_is_supported(change, needle):
    with pytest.raises(hf.ExportError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        hf.config_from_hf({**SMOLLM2_135M, **change}, "config.json")


def test_pickled_weights_are_refused_and_a_sharded_index_must_stay_inside(tmp_path):
    (tmp_path / hf.CONFIG_FILE).write_text(json.dumps(SMOLLM2_135M))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(hf.ExportError, match="a pickle: loading it could run code"):
        hf.weight_files(tmp_path)
    (tmp_path / hf.INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "../outside.safetensors"}}))
    with pytest.raises(hf.ExportError, match="is not a file name in"):
        hf.weight_files(tmp_path)


def test_a_sharded_model_loads_shard_by_shard(reference, tmp_path):
    kind, ref, _ = reference
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / hf.INDEX_FILE).is_file() and len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = hf.load_hf(tmp_path)
    doc = documents()[1][0]
    with torch.no_grad():
        mine = ours(torch.as_tensor(doc.tokens)[None], return_logits=True).logits[0]
    assert (mine - reference_logits(ref, doc)).abs().max() <= TOL


# ---------------------------------------------------------------------------------------------------
# train.init_from=<a Hugging Face directory>: a real run
# ---------------------------------------------------------------------------------------------------


def test_init_from_a_llama_directory_trains_and_exports_back(transformers, demo_data, tmp_path):
    """The model section comes from config.json (no model= given); the weights survive a run with lr 0 (one
    step) and its export exactly; a contradicting model= is one line."""
    vocab = load_tokenizer(demo_data / "tokenizer").get_vocab_size()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    ref = transformers.LlamaForCausalLM(config).eval()
    model_dir = tmp_path / "llama"
    ref.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_bytes((demo_data / "tokenizer" / name).read_bytes())

    run = tmp_path / "run"
    proc = run_train(run, demo_data, f"train.init_from={model_dir}", "train.max_steps=1", "train.seq_len=128",
                     "optim.lr=0.0", "optim.weight_decay=0.0", "train.eval_every=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "init_from: weights of" in proc.stdout and "LlamaForCausalLM" in proc.stdout
    ckpt = latest_checkpoint(run)
    conv = json.loads((ckpt / "conventions.json").read_text())
    assert (conv["init_from"]["architecture"] == "LlamaForCausalLM"
            and conv["init_from"]["hf_model"] == str(model_dir))
    assert (conv["tokenizer"]["framing"]["add_bos"] is False
            and conv["tokenizer"]["framing"]["pad_from"] == "pad_token")
    saved = json.loads((ckpt / "meta.json").read_text())["config"]["model"]
    assert (saved["n_kv_head"], saved["norm"], saved["tie_embeddings"],
            saved["max_seq_len"]) == (2, "rmsnorm", False, 256)
    out = tmp_path / "export"
    from trainer.export import export

    export(ckpt, out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(back) is transformers.LlamaForCausalLM
    theirs = dict(ref.named_parameters())
    for name, p in back.named_parameters():
        assert torch.equal(p, theirs[name]), name

    # The same tokenizer.json framed otherwise (BOS added by the config) is refused before any weight is read.
    framed = tmp_path / "framed"
    framed.mkdir()
    for file in model_dir.iterdir():
        (framed / file.name).write_bytes(file.read_bytes())
    config = json.loads((framed / "tokenizer_config.json").read_text())
    (framed / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    model = hf.load_hf(model_dir)
    from trainer.checkpoint.weights import WeightsError, init_from_checkpoint
    from trainer.data.tokenizer import tokenizer_hash

    with pytest.raises(WeightsError, match="frames documents as"):
        init_from_checkpoint(model, framed, demo_data / "tokenizer", tokenizer_hash(demo_data / "tokenizer"),
                             [])

    proc = subprocess.run([sys.executable, "-m", "trainer.train", f"data.path={demo_data}",
                           f"hydra.run.dir={tmp_path}/bad", f"train.init_from={model_dir}", "model=small",
                           "logging.wandb.mode=disabled"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert_one_error_line(proc.returncode, proc.stderr,
                          "is a Hugging Face model whose config.json gives the model",
                          "model.bias=True (config.json: False)")


def test_an_hf_init_from_whose_vocabulary_is_smaller_than_the_datas_tokenizer_gives_the_right_advice(
        transformers, demo_data, tmp_path):
    """Issue 54: a Hugging Face model of 100 tokens, the data's tokenizer of 512: one ConfigError naming its
    config.json and the data's tokenizer, advising to prepare the data with the model's tokenizer (before:
    "set model.vocab_size=null", which the Hugging Face init_from then refuses)."""
    from tests.helpers import make_trainer
    from trainer.errors import ConfigError

    model_dir = tmp_path / "small_vocab"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=100, n_positions=128, n_embd=32,
                                                         n_layer=1, n_head=2)).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_bytes((demo_data / "tokenizer" / name).read_bytes())
    with pytest.raises(ConfigError) as refused:
        make_trainer(demo_data, tmp_path / "run", f"train.init_from={model_dir}")
    message = str(refused.value)
    assert ("its config.json says vocab_size 100, fewer than the 512 ids of the data's tokenizer"
            in message), message
    assert f"--tokenizer {model_dir}" in message and "vocab_size=null" not in message, message
