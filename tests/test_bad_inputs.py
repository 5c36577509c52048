"""Every user mistake ends as ONE line, `error: ...` on stderr, exit status 2 (Ctrl-C: 130), and leaves what
the user had intact: a table of bad inputs, one row per mistake, covering every key of
trainer.registry.CONFIG_KEYS.

Three kinds of rows, cheapest first:
    CONFIG_ROWS    overrides composed by Hydra's compose API and built by trainer.train.build_config (what
                   `python -m trainer.train` runs), in this process, through run_command: exit 2, one line
    CALL_ROWS      a damaged checkpoint, a resume with other settings, a report or command argument: the
                   function the command calls (or the command's main) in this process, through run_command
    COMMAND_ROWS   a handful as real commands (the train rows through trainer.train.cli() in one process, the
                   others as python -m trainer.<command>, side by side): exit status 2, exactly one stderr
                   line `error: ...`, no "Traceback", and what must be intact afterwards
The SIGINT row interrupts a real training run (Ctrl-C to its process group).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

import trainer.distributed.config as distributed_config
from tests.helpers import ENV, LLAMA3, ROOT, SMALL, TRAIN_CLI_DRIVER, assert_one_error_line, hf_tokenizer_dir
from tests.shards import NEGATIVE, PLAIN, damaged_shard, ids_of, read_stored, with_size
from trainer import evaluate, export, generate, harness, inspect_mask, launcher, prepare, report
from trainer.checkpoint import store
from trainer.checkpoint.safe_io import save_state
from trainer.checkpoint.weights import checkpoint_conventions
from trainer.config import from_container
from trainer.data.config import DataConfig
from trainer.data.feed import load_eval_docs
from trainer.data.reshape import reshape_state
from trainer.data.shards import ids_member
from trainer.distributed.groups import DistInfo
from trainer.errors import EXIT_INTERRUPTED, run_command
from trainer.registry import CONFIG_KEYS
from trainer.reporting import runs as report_runs
from trainer.reporting import verdicts as report_verdicts
from trainer.run.checkpointer import Checkpointer, check_resumable
from trainer.run.inputs import build_data
from trainer.tasks.suite import load_suite
from trainer.train import HYDRA_ERRORS, build_config, user_message

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))

# ---------------------------------------------------------------------------------------------------
# CONFIG_ROWS: (config key, overrides on top of tests.helpers.SMALL, regex the one error line must match)
# ---------------------------------------------------------------------------------------------------

CONFIG_ROWS: list[tuple[str, tuple[str, ...], str]] = [
    ("seed", ("seed=-1",), r"seed must be in \[0, 4294967295\], got -1"),
    ("seed", ("seed=abc",), r"seed must be an integer, got 'abc'"),
    # train
    ("train.seq_len", ("train.seq_len=1",), r"train.seq_len must be >= 2, got 1"),
    ("train.tokens_per_step", ("train.tokens_per_step=1000",),
     r"train.tokens_per_step \(1000\) must be a positive multiple of train.seq_len \(128\)"),
    ("train.tokens_per_step", ("train.tokens_per_step=-128",),
     r"train.tokens_per_step \(-128\) must be a positive .*use train.tokens_per_step=128 \(1 row\)$"),
    ("train.micro_batch_tokens", ("train.micro_batch_tokens=64",),
     r"train.micro_batch_tokens \(64\) must hold one row"),
    ("train.max_steps", ("train.max_steps=-1",), r"train.max_steps must be >= 1, got -1"),
    ("train.max_steps", ("train.max_steps=0",), r"train.max_steps must be >= 1, got 0"),
    ("train.grad_clip", ("train.grad_clip=-1",), r"train.grad_clip must be >= 0, got -1"),
    ("train.grad_clip", ("train.grad_clip=nan",), r"train.grad_clip must be >= 0, got nan"),
    ("train.dtype", ("train.dtype=fp16",),
     r"train.dtype must be one of \('auto', 'fp32', 'bf16'\), got 'fp16'"),
    ("train.compile", ("train.compile=maybe",), r"train.compile must be true or false, got 'maybe'"),
    ("train.checkpoint_every", ("train.checkpoint_every=-1",),
     r"train.checkpoint_every must be >= 0, got -1"),
    ("train.keep_last", ("train.keep_last=0",), r"train.keep_last must be >= 1, got 0"),
    ("train.resume", ("train.resume=''",), r"train.resume must be a checkpoint path, not an empty string"),
    ("train.resume", ("train.resume=[a]",), r"train.resume must be true or false or a string, got \['a'\]"),
    ("train.overwrite", ("train.overwrite=maybe",), r"train.overwrite must be true or false, got 'maybe'"),
    ("train.overwrite", ("train.overwrite=true", "train.resume=true"),
     r"train.overwrite=true replaces .* and train.resume=true continues it: set only one of them"),
    ("train.init_from", ("train.init_from=''",),
     r"train.init_from must be a checkpoint path, not an empty string"),
    ("train.warmup_marked_steps", ("train.warmup_marked_steps=-2",),
     r"train.warmup_marked_steps must be >= 0, got -2"),
    ("train.eval_every", ("train.eval_every=-1",), r"train.eval_every must be >= 0"),
    ("train.eval_docs", ("train.eval_docs=0",), r"train.eval_docs null or >= 1, got -?\d+ and 0"),
    ("train.eval_layout", ("train.eval_layout=bucketed",),
     r"train.eval_layout must be 'packed' or 'unpacked'"),
    ("train.eval_tasks", ("train.eval_tasks=3",),
     r"train.eval_tasks must be a list of task files or built-in names, got 3"),
    ("train.eval_tasks", ("train.eval_tasks=['']",),
     r"train.eval_tasks must be a list of task files or built-in names, got \[''\]"),
    ("train.eval_tasks", ("train.eval_tasks=[cloze]", "distributed=fsdp2"),
     r"train.eval_tasks scores through the unwrapped model, which distributed.engine=fsdp2 shards: use "
     r"distributed=ddp, or score the run's checkpoints with python -m trainer.evaluate"),
    ("train.eval_tasks_every", ("train.eval_tasks_every=-2",),
     r"train.eval_tasks_every must be null or >= 0, got -2"),
    ("train.eval_tasks_layout", ("train.eval_tasks_layout=dense",),  # issue 57
     r"train.eval_tasks_layout must be tree, packed or unpacked, got 'dense'"),
    # issue 57: a tree layout refused at start
    ("train.eval_tasks", ("train.eval_tasks=[cloze]", "attention=flash"),
     r"train.eval_tasks_layout=tree scores each item as a tree .* attention=flash cannot express"),
    ("train.on_nonfinite", ("train.on_nonfinite=ignore",), r"train.on_nonfinite must be 'stop' or 'skip'"),
    ("train.on_nonfinite", ("train.on_nonfinite=skip", "distributed=deepspeed_zero2"),
     r"train.on_nonfinite=skip needs distributed.engine=ddp"),
    ("train.activation_checkpointing", ("train.activation_checkpointing=half",),
     r"train.activation_checkpointing must be one of"),
    ("tokenizer.add_tokens", ('tokenizer.add_tokens=[""]',),
     r"tokenizer.add_tokens must be a list of non-empty"),
    ("tokenizer.add_tokens", ("tokenizer.add_tokens=[a,a]",), r"tokenizer.add_tokens lists a token twice"),
    ("tokenizer.add_tokens", ("tokenizer.add_tokens=[a]",), r"set train.init_from=CHECKPOINT too"),
    # loss
    ("loss.normalization", ("loss.normalization=bogus",), r"loss.normalization must be one of"),
    ("loss.chunk_tokens", ("loss.chunk_tokens=-1",), r"loss.chunk_tokens must be >= 0"),
    # data
    ("data.path", ("data.path=''",), r"data.path must not be an empty string"),
    ("data.path", ("data.path=[a,b]",), r"data.path must be a string or null, got \['a', 'b'\]"),
    ("data.urls", ("data.urls=[]",), r"data.urls must be a string or a non-empty list of strings, got \[\]"),
    ("data.val_urls", ("data.val_urls=[1]",),
     r"data.val_urls must be a string or a non-empty list of strings"),
    ("data.tokenizer", ("data.tokenizer={a: 1}",), r"data.tokenizer must be a string or null"),
    ("data.split", ("data.split=''",), r"data.split must not be an empty string"),
    ("data.num_workers", ("data.num_workers=-1",), r"data.num_workers must be >= 0, got -1"),
    ("data.shuffle_buffer", ("data.shuffle_buffer=0",), r"data.shuffle_buffer must be >= 1, got 0"),
    ("data.on_error", ("data.on_error=ignore",), r"data.on_error must be 'raise' or 'skip'"),
    ("data.retries", ("data.retries=-1",), r"data.retries must be >= 0, got -1"),
    ("data.read_timeout_s", ("data.read_timeout_s=0",),
     r"data.read_timeout_s must be in \(0, 86400\] seconds, got 0"),
    ("data.read_timeout_s", ("data.read_timeout_s=nan",), r"data.read_timeout_s must be in \(0, 86400\]"),
    ("data.max_doc_mb", ("data.max_doc_mb=0",), r"data.max_doc_mb must be a finite number > 0, got 0"),
    ("data.loss_on", ("data.loss_on=user",), r"data.loss_on must be one of \('all', 'assistant'\)"),
    ("data.prefetch", ("data.prefetch=maybe",), r"data.prefetch must be true or false, got 'maybe'"),
    ("data.balance", ("data.balance=tokens",),
     r"data.balance must be one of \('none', 'rows'\), got 'tokens'"),
    ("data.epoch_lockstep", ("data.epoch_lockstep=2",), r"data.epoch_lockstep must be true or false, got 2"),
    ("data.sources", ("data.sources=[]",),
     r"data.sources must be a non-empty list of \{name, path or urls, weight\}"),
    ("data.sources", ("data.sources=[{name:a,weight:1}]",),
     r"data.sources\[0\] \(a\) needs path \(a directory"),
    ("data.sources", ("data.sources=[{name:a,path:x},{name:a,path:y}]",),
     r"data.sources\[1\].name 'a' names two"),
    ("data.sources", ("data.sources=[{name:a,path:x,weight:0}]",),
     r"data.sources\[0\].weight \(a\) must be a number > 0"),
    ("data.sources", ("data.sources=[{name:'a b',path:x}]",),
     r"data.sources\[0\].name must be a name of letters"),
    ("data.sources", ("data.sources=[{name:a,path:x,wieght:1}]",),
     r"data.sources\[0\]: unknown key\(s\) \['wieght'\]"),
    ("data.sources", ("data.sources=[{name:a,path:x}]", "data.path=y"),
     r"data.sources replaces data.path, data.urls"),
    ("data.sources", ("data.sources=[{name:a,path:x,weight:1e300},{name:b,path:y,weight:1e-300}]",),
     r"data.sources: the weights \[1e\+300, 1e-300\] give b a share of 0 of the tokens, below 1e-09: it "
     r"would never"),
    ("data.sources", ("data.sources=[{name:a,path:x,weight:1e308},{name:b,path:y,weight:1e308}]",),
     r"data.sources: the weights \[1e\+308, 1e\+308\] add up to inf"),
    ("data.mix_exhausted", ("data.mix_exhausted=never",),
     r"data.mix_exhausted must be one of \('stop', 'restart'\)"),
    # packing
    ("packing.layout", ("packing.layout=zigzag",), r"packing.layout must be one of"),
    ("packing.buffer_size", ("packing.buffer_size=0",), r"packing.buffer_size must be >= 1, got 0"),
    ("packing.long_docs", ("packing.long_docs=keep",), r"packing.long_docs must be one of"),
    ("packing.reset_positions", ("packing.reset_positions=maybe",),
     r"packing.reset_positions must be true or false"),
    ("packing.pad_to", ("packing.pad_to=max",), r"packing.pad_to must be one of"),
    # model
    ("model.vocab_size", ("model.vocab_size=0",), r"model.vocab_size must be >= 1, got 0"),
    ("model.n_layer", ("model.n_layer=0",), r"model.n_layer must be >= 1, got 0"),
    ("model.n_head", ("model.n_head=0",), r"model.n_head must be >= 1, got 0"),
    ("model.n_head", ("model.n_head=5",), r"model.n_embd=64 is not divisible by model.n_head=5"),
    ("model.n_embd", ("model.n_embd=0",), r"model.n_embd must be >= 1, got 0"),
    ("model.max_seq_len", ("model.max_seq_len=64",),
     r"model.max_seq_len \(64\) must be >= train.seq_len \(128\)"),
    ("model.max_seq_len", ("model.max_seq_len=0",), r"model.max_seq_len must be >= 1, got 0"),
    ("model.dropout", ("model.dropout=-0.5",), r"model.dropout must be in \[0, 1\), got -0.5"),
    ("model.dropout", ("model.dropout=1.0",), r"model.dropout must be in \[0, 1\), got 1.0"),
    ("model.bias", ("model.bias=maybe",), r"model.bias must be true or false"),
    ("model.pos_emb", ("model.pos_emb=rope", "model.n_head=64"),
     r"model.pos_emb=rope needs an even head dimension"),
    ("model.pos_emb", ("model.pos_emb=alibi",),
     r"model.pos_emb must be one of \('learned', 'rope'\), got 'alibi'"),
    ("model.rope_theta", ("model.rope_theta=0",), r"model.rope_theta must be > 0, got 0"),
    ("model.init_std", ("model.init_std=-1",), r"model.init_std must be > 0, got -1"),
    ("model.norm", ("model.norm=batchnorm",),
     r"model.norm must be one of \('layernorm', 'rmsnorm'\), got 'batchnorm'"),
    ("model.norm_eps", ("model.norm_eps=0",), r"model.norm_eps must be > 0, got 0"),
    ("model.mlp", ("model.mlp=relu",), r"model.mlp must be one of \('gelu', 'swiglu'\), got 'relu'"),
    ("model.mlp_hidden", ("model.mlp_hidden=0",), r"model.mlp_hidden must be >= 1, got 0"),
    ("model.n_kv_head", ("model.n_kv_head=3",), r"model.n_head=4 is not divisible by model.n_kv_head=3"),
    ("model.qkv_bias", ("model.qkv_bias=maybe",),
     r"model.qkv_bias must be true or false or null, got 'maybe'"),
    ("model.tie_embeddings", ("model.tie_embeddings=maybe",), r"model.tie_embeddings must be true or false"),
    ("model.family", ("model.family=falcon",),
     r"model.family='falcon' is not a family packtrain knows; families: gpt2, llama, qwen2, mistral"),
    ("model.family", ("model.family=gpt2", "model=llama-tiny"),
     r"model.family=gpt2: GPT2LMHeadModel does not compute this model \(pos_emb=rope"),
    ("model.rope_scaling", ("model.pos_emb=rope", "model.rope_scaling={rope_type:yarn,factor:2.0}"),
     r"model.rope_scaling: rope_type 'yarn' is not supported; supported: \('default', 'linear', 'llama3'\)"),
    ("model.rope_scaling", ("model.rope_scaling={rope_type:linear,factor:2.0}",),
     r"model.rope_scaling scales rotary positions: it needs model.pos_emb=rope"),
    ("model.rope_scaling", ("model.pos_emb=rope", "model.rope_scaling={rope_type:linear}"),
     r"rope_type 'linear' needs a positive number factor, got None"),
    # attention
    ("attention.backend", ("attention.backend=bogus",), r"unknown attention backend 'bogus'"),
    ("attention.backend", ("attention=bogus",), r"Could not find 'attention/bogus'"),
    ("attention.isolate_documents", ("attention.isolate_documents=maybe",),
     r"attention.isolate_documents must be true or false"),
    ("attention.flex_compile", ("attention.flex_compile=2",),
     r"attention.flex_compile must be true or false, got 2"),
    # optim
    ("optim._target_", ("optim._target_=nope.Nope",),
     r"optim._target_ must name an optimizer class .*'nope.Nope'"),
    ("optim.lr", ("optim.lr=-1",), r"optim.lr must be >= 0, got -1"),
    ("optim.lr", ("optim.lr=nan",), r"optim.lr must be >= 0, got nan"),
    ("optim.betas", ("optim.betas=[2,3]",), r"optim.betas\[0\] must be in \[0, 1\), got 2"),
    ("optim.betas", ("optim.betas=0.9",), r"optim.betas must be two numbers in \[0, 1\)"),
    ("optim.eps", ("optim.eps=0",), r"optim.eps must be > 0, got 0"),
    ("optim.weight_decay", ("optim.weight_decay=-0.1",), r"optim.weight_decay must be >= 0, got -0.1"),
    ("optim.warmup_steps", ("optim.warmup_steps=-1",), r"optim.warmup_steps must be >= 0, got -1"),
    ("optim.min_lr_ratio", ("optim.min_lr_ratio=-5",), r"optim.min_lr_ratio must be in \[0, 1\], got -5"),
    ("optim.fused", ("optim.fused=maybe",), r"optim.fused must be auto, true or false, got 'maybe'"),
    # distributed
    ("distributed.engine", ("distributed.engine=horovod",), r"distributed.engine must be one of"),
    ("distributed.backend", ("distributed.backend=mpi",), r"distributed.backend must be one of .*got 'mpi'"),
    ("distributed.device", ("distributed.device=tpu",), r"distributed.device must be one of .*got 'tpu'"),
    ("distributed.zero_stage", ("distributed.zero_stage=1",),
     r"distributed.zero_stage exists only with distributed.engine=deepspeed.*distributed=deepspeed_zero1"),
    ("distributed.zero_stage", ("distributed=deepspeed_zero2", "distributed.zero_stage=4"),
     r"distributed.zero_stage must be 1, 2 or 3 with engine=deepspeed, got 4"),
    ("distributed.zero_stage", ("train.compile=true", "distributed=deepspeed_zero3"),
     r"train.compile=true does not run under ZeRO-3"),
    ("distributed.context_parallel", ("distributed.context_parallel=0",),
     r"distributed.context_parallel must be an integer >= 1, got 0"),
    # the ranks first (issue 46), then the rows
    ("distributed.context_parallel", ("distributed.context_parallel=3",),
     r"error: distributed.context_parallel=3 must divide the number of ranks \(1\): .*; "
     r"distributed.context_parallel=3 with the balanced split cuts each row into 24 equal chunks: "
     r"train.seq_len \(128\) must be a multiple of 24"),
    ("train.save_weights", ("train.save_weights=never",),
     r"train.save_weights must be 'end' or 'every', got 'never'"),
    ("distributed.tensor_parallel", ("distributed.tensor_parallel=0",),
     r"distributed.tensor_parallel must be an integer >= 1, got 0"),
    ("distributed.tensor_parallel", ("distributed.tensor_parallel=3",),
     r"error: distributed.tensor_parallel=3 must divide the number of ranks \(1\): .*model.n_head \(4\) "
     r"must be a multiple of 3"),
    ("distributed.tensor_parallel", ("distributed=deepspeed_zero2", "distributed.tensor_parallel=2"),
     r"distributed.tensor_parallel > 1 runs under distributed.engine=ddp or fsdp2: DeepSpeed wraps the whole "
     r"model"),
    ("distributed.context_parallel_split", ("distributed.context_parallel_split=random",),
     r"distributed.context_parallel_split must be one of \('balanced', 'zigzag', 'documents'\), got "
     r"'random'"),
    ("distributed.context_parallel", ("distributed.context_parallel=8",
                                      "distributed.context_parallel_strategy=ulysses"),
     r"ulysses splits the heads over the group: model.n_head \(4\) must be a multiple of"),
    ("distributed.context_parallel", ("distributed.context_parallel=2", "attention=flex"),
     r"allgather needs an attention backend that takes separate query and key lengths .* got "
     r"attention.backend=flex"),
    ("distributed.context_parallel", ("distributed.context_parallel=2", "train.compile=true"),
     r"train.compile=true is not supported with distributed.context_parallel > 1"),
    ("distributed.context_parallel_strategy", ("distributed.context_parallel_strategy=ring",),
     r"distributed.context_parallel_strategy must be one of \('allgather', 'ulysses'\), got 'ring'"),
    ("distributed.offload", ("distributed.offload=true",), r"distributed.offload exists only with"),
    ("distributed.offload", ("distributed=fsdp2", "distributed.offload=true", "distributed.device=cpu"),
     r"distributed.offload=true keeps FSDP2's shards on the CPU between uses, and this run's device is the "
     r"CPU"),
    ("distributed.reshard_after_forward", ("distributed.reshard_after_forward=false",),
     r"distributed.reshard_after_forward exists only with distributed.engine=fsdp2.*choose "
     r"distributed=fsdp2"),
    ("distributed.reshard_after_forward", ("distributed=fsdp2",
                                           "distributed.reshard_after_forward=sometimes"),
     r"distributed.reshard_after_forward must be true or false, got 'sometimes'"),
    ("distributed.zero_stage", ("distributed=fsdp2", "distributed.zero_stage=3"),
     r"distributed.zero_stage exists only with distributed.engine=deepspeed, which the chosen distributed= "
     r"option"),
    ("distributed.offload", ("distributed=deepspeed_zero2", "distributed.offload=maybe"),
     r"distributed.offload must be true or false"),
    # logging
    ("logging.log_every", ("logging.log_every=0",), r"logging.log_every must be >= 1, got 0"),
    ("logging.length_buckets", ("logging.length_buckets=[256,64]",),
     r"logging.length_buckets must be increasing positive integers, e.g. \[64, 256, 1024\], got \[256, 64\]"),
    ("logging.position_buckets", ("logging.position_buckets=[0]",),
     r"logging.position_buckets must be increasing positive integers, e.g. \[64, 256, 1024\], got \[0\]"),
    ("logging.progress", ("logging.progress=maybe",), r"logging.progress must be true or false"),
    ("logging.record_doc_keys", ("logging.record_doc_keys=2",),
     r"logging.record_doc_keys must be true or false"),
    ("logging.wandb.mode", ("logging.wandb.mode=bogus",),
     r"logging.wandb.mode must be one of \('offline', 'online', 'disabled'\), got 'bogus'"),
    ("logging.wandb.project", ("logging.wandb.project=''",),
     r"logging.wandb.project must not be an empty string"),
    ("logging.wandb.entity", ("logging.wandb.entity=[a]",), r"logging.wandb.entity must be a string or null"),
    ("logging.wandb.group", ("logging.wandb.group=''",), r"logging.wandb.group must not be an empty string"),
    ("logging.wandb.tags", ("logging.wandb.tags=abc",),
     r"logging.wandb.tags must be a list of non-empty strings"),
    # Hydra's own: a malformed override, an unknown key
    ("hydra.*", ("train.seq_len=[1",), r"cannot parse the override 'train.seq_len=\[1'"),
    ("hydra.*", ("train.bogus=1",), r"unknown config key 'train.bogus'"),
]


@pytest.fixture(scope="module")
def hydra_configs():
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        yield


GROUPS = {p.name for p in (ROOT / "configs").iterdir() if p.is_dir()}
_composed_groups: dict[tuple[str, ...], DictConfig] = {}


def hydra_config(*overrides: str) -> DictConfig:
    """What Hydra's compose gives for SMALL + `overrides`, in ~10 ms instead of ~300: the config-group
    selections are composed once per selection (compose API, cached), and the value overrides applied to a
    copy the way compose applies them (parsed by Hydra, then ConfigLoaderImpl._apply_overrides_to_config on
    the struct config). test_the_fast_compose_is_hydra_s_compose checks that both give the same error line."""
    # a malformed override fails here, as in compose
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    groups = tuple(o.input_line for o in parsed
                   if o.key_or_group.split("/")[0] in GROUPS or o.package is not None)
    if groups not in _composed_groups:
        _composed_groups[groups] = compose(config_name="config", overrides=[*SMALL, *groups])
    cfg = copy.deepcopy(_composed_groups[groups])
    ConfigLoaderImpl._apply_overrides_to_config([o for o in parsed if o.input_line not in groups], cfg)
    return cfg


def composed(*overrides: str) -> dict:
    """The resolved config of `overrides` on SMALL (as plain containers); inside `hydra_configs`."""
    return OmegaConf.to_container(hydra_config(*overrides), resolve=True)


def one_error(capsys, action: Callable[[], object], extra=()) -> str:
    """Run `action` as a command runs (trainer.errors.run_command, train's message): assert exit status 2 and
    one `error: ` line on stderr, and return that line."""
    capsys.readouterr()
    status = run_command(action, extra_user_errors=(*HYDRA_ERRORS, *extra), message=user_message)
    return assert_one_error_line(status, capsys.readouterr().err)


@pytest.mark.parametrize("key, overrides, message", CONFIG_ROWS, ids=[" ".join(r[1]) for r in CONFIG_ROWS])
def test_a_bad_config_value_is_one_error_line_naming_it(hydra_configs, capsys, tmp_path, key, overrides,
                                                        message):
    line = one_error(capsys, lambda: build_config(hydra_config(*overrides), str(tmp_path / "run")))
    assert re.search(message, line), (message, line)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides", [("model.n_head=0",), ("train.seq_len=[1",), ("train.bogus=1",),
                                       ("distributed.zero_stage=1",), ("train.resume=''",),
                                       ("distributed=deepspeed_zero2", "distributed.zero_stage=4")])
def test_the_fast_compose_is_hydra_s_compose(hydra_configs, capsys, tmp_path, overrides):
    def line(make_config) -> str:
        return one_error(capsys, lambda: build_config(make_config(), str(tmp_path)))

    assert line(lambda: hydra_config(*overrides)) == line(
        lambda: compose(config_name="config", overrides=[*SMALL, *overrides]))


def test_the_shipped_configs_still_build(hydra_configs, tmp_path):
    for overrides in [(), ("experiment=demo",), ("experiment=sft", "train.init_from=x"),
                      ("experiment=mixture_ablation",),
                      ("model=small",),
                      ("model=gpt2-124m",),
                      ("distributed=deepspeed_zero1",),
                      ("distributed=deepspeed_zero3", "distributed.offload=true")]:
        if (overrides and overrides[0].startswith("distributed=deepspeed")
                and importlib.util.find_spec("deepspeed") is None):
            continue  # refused where deepspeed is not installed (the next test)
        build_config(compose(config_name="config", overrides=[*SMALL, *overrides]), str(tmp_path))


def test_the_mixture_preset_sweeps_four_runs_that_build(hydra_configs, tmp_path):
    """experiment=mixture_ablation's sweep (two whole data.sources lists x packing), parsed as Hydra's basic
    sweeper parses it: 2 x 2 runs, each a valid config with a two-source mixture."""
    composed = compose(config_name="config", overrides=["experiment=mixture_ablation"],
                       return_hydra_config=True)
    parser = OverridesParser.create()
    axes = [list(parser.parse_override(f"{key}={value}").sweep_iterator())
            for key, value in composed.hydra.sweeper.params.items()]
    assert [len(axis) for axis in axes] == [2, 2]
    weights = []
    assert list(composed.hydra.sweeper.params) == ["data.sources", "packing"]
    for sources, layout in [(a, b) for a in axes[0] for b in axes[1]]:
        cfg = compose(config_name="config",
                      overrides=[*SMALL, "experiment=mixture_ablation", f"packing={layout}"])
        cfg.data.sources = sources
        run = build_config(cfg, str(tmp_path / "run"))
        assert [s.name for s in run.data.mixture()] == ["functions", "modules"]
        weights.append(tuple(s.weight for s in run.data.mixture()))
    assert sorted(set(weights)) == [(0.3, 0.7), (0.7, 0.3)]


def test_an_engine_whose_package_is_not_installed_is_one_error_line(hydra_configs, capsys, monkeypatch,
                                                                    tmp_path):
    """deepspeed is installed here: the engine's module is swapped for a name that cannot import."""
    monkeypatch.setitem(distributed_config.ENGINE_MODULES, "deepspeed", "packtrain_no_such_module")
    line = one_error(capsys, lambda: build_config(
        compose(config_name="config", overrides=[*SMALL, "distributed=deepspeed_zero2"]), str(tmp_path)))
    assert "distributed.engine=deepspeed needs the 'packtrain_no_such_module' package" in line, line
    assert "use distributed=ddp" in line


# ---------------------------------------------------------------------------------------------------
# CALL_ROWS: checkpoints, resumes, the other commands' arguments, in this process
# ---------------------------------------------------------------------------------------------------


def fake_checkpoint(root: Path, meta: dict | None = None, conventions=None) -> Path:
    """A checkpoint directory holding only meta.json (and conventions.json): what is read before anything
    else."""
    path = store.checkpoint_dir(root, 3)
    path.mkdir(parents=True)
    (path / store.META_FILE).write_text(json.dumps(meta) if isinstance(meta, dict) else str(meta))
    if conventions is not None:
        (path / store.CONVENTIONS_FILE).write_text(conventions)
    return path


Call = Callable[[Path, Callable[[str], Any]], int | None]
"""A row's action: (a fresh directory, pytest's getfixturevalue) -> the exit status, or None after it
raised."""


def resumed_with(*overrides: str) -> Call:
    """Resume a checkpoint written with SMALL under `overrides` (check_resumable, as Trainer does first)."""
    def call(tmp: Path, _) -> None:
        path = fake_checkpoint(tmp, {"step": 3, "world_size": 1, "config": composed()})
        check_resumable(path, composed(*overrides))
    return call


def damaged_meta(text: str) -> Call:
    return lambda tmp, _: store.read_meta(fake_checkpoint(tmp, text))


def damaged_conventions(text: str) -> Call:
    return lambda tmp, _: checkpoint_conventions(fake_checkpoint(tmp, {"step": 3, "world_size": 1}, text))


def numeric_resume(tmp: Path, _) -> None:
    """train.resume=123: Hydra reads the path as an int; resolved and read as the trainer does."""
    cfg = from_container(composed("train.resume=123"), str(tmp / "run"))
    checkpointer = Checkpointer(tmp / "run", CPU, 0, 1, 1)
    store.read_meta(checkpointer.resume_path(cfg.train.resume))


def missing_rank_file(tmp: Path, _) -> None:
    """A checkpoint of 2 ranks whose rank_00001.pt is gone, resumed on 1 rank (which reads every rank's)."""
    path = fake_checkpoint(tmp, {"step": 3, "world_size": 2})
    save_state({"rng": {}}, path / store.rank_file(0))
    store.load_rank_states(path, range(2))


def reshaped_without_lockstep(tmp: Path, _) -> None:
    """A data stream dealt over another shape with data.epoch_lockstep=false (trainer.data.reshape)."""
    reshape_state([], None, 1, lockstep=False)


def reshaped_mixture(tmp: Path, _) -> None:
    """A data mixture's stream state dealt over another shape by a run that reads one source."""
    reshape_state([{"docs": {"mixture": {"names": ["code", "prose"]}, "num_workers": 1}}], None, 1,
                  lockstep=True)


def one_source_state_into_a_mixture(tmp: Path, fixture) -> None:
    """A one-source run's data state loaded by a run with data.sources (the same directory twice)."""
    demo = fixture("demo_data")
    single = build_data(from_container(composed(f"data.path={demo}", "data.num_workers=0"),
                                       str(tmp / "a")), CPU)
    state = single.rows.state_dict()
    mix = f"data.sources=[{{name:a,path:'{demo}'}},{{name:b,path:'{demo}'}}]"
    mixed = build_data(from_container(composed(mix, "data.num_workers=0"), str(tmp / "b")), CPU)
    try:
        mixed.rows.load_state_dict(state)
    finally:
        single.rows.close()
        mixed.rows.close()


one_source_state_into_a_mixture.fixtures = ("demo_data",)


def into_a_dataset(tmp: Path, fixture) -> None:
    """inspect_mask --out a prepared dataset (a copy of the demo data): refused, the dataset untouched."""
    dataset = tmp / "dataset"
    shutil.copytree(fixture("demo_data"), dataset)
    before = sorted(p.name for p in dataset.iterdir())
    try:
        return inspect_mask.main(["--lengths", "3,2", "--row-len", "8", "--out", str(dataset)])
    finally:
        assert sorted(p.name for p in dataset.iterdir()) == before


into_a_dataset.fixtures = ("demo_data",)


def over_a_users_page(tmp: Path, _) -> None:
    """inspect_mask --out a directory holding someone's own mask.html: refused, the page kept."""
    (tmp / "mine").mkdir()
    (tmp / "mine" / "mask.html").write_text("<html>my notes</html>")
    try:
        return inspect_mask.main(["--lengths", "3,2", "--row-len", "8", "--out", str(tmp / "mine")])
    finally:
        assert (tmp / "mine" / "mask.html").read_text() == "<html>my notes</html>"


def inside_a_runs_checkpoints(tmp: Path, _) -> None:
    """inspect_mask --out RUN/checkpoints (issue 46: only the run dir itself was refused): refused, nothing
    written."""
    (tmp / "run" / "checkpoints").mkdir(parents=True)
    (tmp / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    try:
        return inspect_mask.main(["--lengths", "3,2", "--row-len", "8", "--out",
                                  str(tmp / "run" / "checkpoints")])
    finally:
        assert list((tmp / "run" / "checkpoints").iterdir()) == []


def mixture_state_into_one_source(tmp: Path, fixture) -> None:
    """A mixture run's data state loaded by a run of one source (data.path)."""
    demo = fixture("demo_data")
    mix = f"data.sources=[{{name:a,path:'{demo}'}},{{name:b,path:'{demo}'}}]"
    mixed = build_data(from_container(composed(mix, "data.num_workers=0"), str(tmp / "b")), CPU)
    single = build_data(from_container(composed(f"data.path={demo}", "data.num_workers=0"),
                                       str(tmp / "a")), CPU)
    try:
        single.rows.load_state_dict(mixed.rows.state_dict())
    finally:
        single.rows.close()
        mixed.rows.close()


mixture_state_into_one_source.fixtures = ("demo_data",)


def command_main(main: Callable[[list[str]], int], *argv: str, config_json: str | None = None) -> Call:
    """A command's own main (decorated with trainer.errors.command: it prints its line and returns the
    status); `config_json`: first write {tmp}/runs/a with that config.json and one metrics line (for
    report)."""
    def call(tmp: Path, _) -> int:
        if config_json is not None:
            (tmp / "runs" / "a").mkdir(parents=True)
            (tmp / "runs" / "a" / "config.json").write_text(config_json)
            (tmp / "runs" / "a" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
        return main([a.replace("{tmp}", str(tmp)) for a in argv])
    return call


def hf_tokenizer_prepare(source: str = "demo", post_processor: str | None = f"{LLAMA3[0]} $A",
                         config_text: str | None = None, **config) -> Call:
    """trainer.prepare --tokenizer a Llama-3-like Hugging Face directory (tests.helpers.hf_tokenizer_dir), its
    tokenizer_config.json given `config` keys (or replaced by `config_text`)."""
    def call(tmp: Path, _) -> int:
        tok = hf_tokenizer_dir(tmp / "tok", LLAMA3, eos=LLAMA3[1], bos=LLAMA3[0],
                               post_processor=post_processor, **config)
        if config_text is not None:
            (tok / "tokenizer_config.json").write_text(config_text)
        return prepare.main(["--source", source, "--out", str(tmp / "out"), "--tokenizer", str(tok)])
    return call


def report_of(config_json: str, *flags: str) -> Call:
    return command_main(report.main, "{tmp}/runs", "--out", "{tmp}/report", *flags, config_json=config_json)


def unreadable_val_shard(tmp: Path, fixture) -> None:
    demo_data = fixture("demo_data")
    data = tmp / "data"
    shutil.copytree(demo_data, data)
    for shard in data.glob("val-*.tar"):
        shard.write_bytes(b"this is no tar file" * 100)
    load_eval_docs(DataConfig(path=str(data), on_error="skip", retries=0), data / "tokenizer", 0, 128,
                   None, "skip")


unreadable_val_shard.fixtures = ("demo_data",)  # made before the row runs: its output is not the row's


def unknown_eval_task(tmp: Path, fixture) -> None:
    """train.eval_tasks naming neither a file nor a built-in: what the Trainer loads before the first step."""
    demo = fixture("demo_data")
    load_suite(["cloze", str(tmp / "missing.jsonl")], "train.eval_tasks", lambda: demo,
               demo / "tokenizer", 128)


unknown_eval_task.fixtures = ("demo_data",)


# Issue 42 (nothing lost, round three): checkpoints that reach outside themselves or hide damage, crafted tar
# headers, shards that are not their manifest entry, stored ids not tied to their text, a run dir of one's own
# files.


def damaged_checkpoint(damage: Callable[[Path], None]) -> Call:
    """The session's checkpoint copied, damaged by `damage(path)`, resumed by path as the trainer does
    first."""
    def call(tmp: Path, fixture) -> None:
        path = store.checkpoint_dir(tmp / "run", 3)
        shutil.copytree(fixture("checkpoint"), path)
        damage(path)
        Checkpointer(tmp / "run", CPU, 0, 1, 1).resume_path(str(path))
    call.fixtures = ("checkpoint",)
    return call


def overwrite_middle(name: str) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        with open(path / name, "r+b") as f:
            f.seek((path / name).stat().st_size // 2)
            f.write(b"\xff" * 64)
    return damage


def symlinked_out(path: Path) -> None:
    outside = path.parents[2] / "outside.safetensors"
    os.replace(path / store.WEIGHTS_FILE, outside)
    (path / store.WEIGHTS_FILE).symlink_to(outside)


def crafted_val_shard(name: str, make: Callable[[], bytes]) -> Call:
    """A crafted tar as the held-out shard (data.val_urls), read as the trainer's start reads it."""
    def call(tmp: Path, fixture) -> None:
        demo = fixture("demo_data")
        (tmp / name).write_bytes(make())
        load_eval_docs(DataConfig(path=str(demo), val_urls=str(tmp / name)), demo / "tokenizer", 0, 128, None)
    call.fixtures = ("demo_data",)
    return call


def damaged_ids(change: Callable[[str, str, bytes, dict], bytes]) -> Call:
    """The demo's first training shard with its members passed through `change(key, field, data, fields)` (the
    key is VICTIM's for a one-sample case), read from its stored ids as a run reads it."""
    def call(tmp: Path, fixture) -> None:
        demo = fixture("demo_data")
        list(read_stored(demo, [damaged_shard(demo, tmp, change)]))
    call.fixtures = ("demo_data",)
    return call


def forged_out_of_vocabulary(key, field, data, fields):
    if field != "ids":
        return data
    ids = ids_of(data).copy()
    ids[3] = 60_000
    return ids_member(ids.tobytes(), fields["txt"])


def written_as_uint32(key, field, data, fields):
    return ids_member(ids_of(data).astype("<u4").tobytes(), fields["txt"]) if field == "ids" else data


def whitespace_text(key, field, data, fields):
    return b"  \n\t" if field == "txt" else data


def users_own_files(tmp: Path, _) -> None:
    """hydra.run.dir naming a directory of the user's own files: refused before a byte is written."""
    from trainer.run.run_dir import claim_run_dir
    (tmp / "mine").mkdir()
    (tmp / "mine" / "thesis.tex").write_text("chapter 1")
    try:
        claim_run_dir(tmp / "mine", False, False, CPU)
    finally:
        assert sorted(p.name for p in (tmp / "mine").iterdir()) == ["thesis.tex"]


# Issue 54 (nothing lost, round four): non-finite weights, and configs that would allocate without bound.


def edited_checkpoint(edit: Callable[[Path], None], command: str = "export") -> Call:
    """The session's checkpoint copied, edited by `edit(path)` with its checksums recorded again (as damage
    before the save would leave it), then exported or generated from."""
    def call(tmp: Path, fixture) -> int:
        path = store.checkpoint_dir(tmp / "run", 3)
        shutil.copytree(fixture("checkpoint"), path)
        edit(path)
        store.record_checksums(path)
        if command == "export":
            return export.main([str(path), "--out", str(tmp / "hf")])
        return generate.main([str(path), "--prompt", "def", "--max-new-tokens", "2"])
    call.fixtures = ("checkpoint",)
    return call


def edited_export(edit: Callable[[Path], None]) -> Call:
    """The session's Hugging Face export copied and edited by `edit(path)`, then generated from."""
    def call(tmp: Path, fixture) -> int:
        path = tmp / "hf"
        shutil.copytree(fixture("exported"), path)
        edit(path)
        return generate.main([str(path), "--prompt", "def", "--max-new-tokens", "2"])
    call.fixtures = ("exported",)
    return call


def out_into(command: str, target: Callable[[Path, Callable], Path], *extra: str) -> Call:
    """`command` (evaluate, harness, report, export) with --out `target(tmp, fixture)`: refused, and every
    file under the checkpoint, dataset or run the target lies in (or the target itself) unchanged."""
    mains = {"evaluate": evaluate.main, "harness": harness.main, "report": report.main, "export": export.main}

    def call(tmp: Path, fixture) -> int:
        out = target(tmp, fixture)
        root = out if out.is_dir() else out.parent
        before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
        try:
            source = [str(tmp / "runs")] if command == "report" else [str(fixture("checkpoint"))]
            if command in ("evaluate", "harness"):
                source += ["--tasks", "cloze"]
            return mains[command]([*source, "--out", str(out), *extra])
        finally:
            assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    call.fixtures = ("checkpoint", "demo_data")
    return call


def copied(fixture_name: str, *inside: str) -> Callable[[Path, Callable], Path]:
    def target(tmp: Path, fixture) -> Path:
        shutil.copytree(fixture(fixture_name), tmp / "copy")
        return tmp.joinpath("copy", *inside)
    return target


def users_file(name: str, text: str = "my notes") -> Callable[[Path, Callable], Path]:
    def target(tmp: Path, _) -> Path:
        (tmp / name).write_text(text)
        return tmp / name
    return target


def a_run_dir(tmp: Path, _) -> Path:
    (tmp / "runs" / "a").mkdir(parents=True)
    (tmp / "runs" / "a" / "config.json").write_text("{}")
    (tmp / "runs" / "a" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    return tmp / "runs" / "a"


def a_foreign_report(tmp: Path, fixture) -> Path:
    a_run_dir(tmp, fixture)
    (tmp / "mine").mkdir()
    (tmp / "mine" / "report.html").write_text("<html>my own report</html>")
    return tmp / "mine"


def unlisted(name: str) -> Callable[[Path], None]:
    """`name`'s entry removed from checksums.json (the file itself damaged, as the entry's removal would
    hide)."""
    def damage(path: Path) -> None:
        manifest = json.loads((path / store.CHECKSUMS_FILE).read_text())
        del manifest["files"][name]
        (path / store.CHECKSUMS_FILE).write_text(json.dumps(manifest))
        overwrite_middle(name)(path)
    return damage


def task_file_row(text: bytes) -> Call:
    """trainer.evaluate on the session's checkpoint with a task file holding `text`."""
    def call(tmp: Path, fixture) -> int:
        (tmp / "task.jsonl").write_bytes(text)
        return evaluate.main([str(fixture("checkpoint")), "--tasks", str(tmp / "task.jsonl")])
    call.fixtures = ("checkpoint",)
    return call


def prepared_into_a_checkpoint(tmp: Path, _) -> int:
    """prepare --out a new directory inside a checkpoint (its checksums would no longer cover it): refused."""
    fake_checkpoint(tmp / "ckpt", {"step": 3, "world_size": 1})
    ckpt = store.checkpoint_dir(tmp / "ckpt", 3)
    shutil.move(ckpt, tmp / "ckpt2")
    shutil.rmtree(tmp / "ckpt")
    (tmp / "ckpt2").rename(tmp / "ckpt")
    try:
        return prepare.main(["--source", "demo", "--out", str(tmp / "ckpt" / "data"), "--max-docs", "10"])
    finally:
        assert sorted(p.name for p in (tmp / "ckpt").iterdir()) == [store.META_FILE]


def nan_in(file: str, key: str, value: float = math.nan) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        from safetensors.torch import load_file, save_file
        weights = load_file(path / file)
        weights[key].view(-1)[3] = value
        save_file(weights, path / file, metadata={"format": "pt"})
    return edit


def json_edit(file: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        value = json.loads((path / file).read_text())
        change(value)
        (path / file).write_text(json.dumps(value))
    return edit


CALL_ROWS: list[tuple[str, Call, str]] = [  # (key or command, call, regex of the error line)
    ("train.resume", damaged_checkpoint(overwrite_middle(store.WEIGHTS_FILE)),
     r"model\.safetensors: checksum mismatch: the checkpoint is damaged; resume from an earlier one$"),
    ("train.resume", damaged_checkpoint(overwrite_middle(store.rank_file(0))),
     r"rank_00000\.pt: checksum mismatch: the checkpoint is damaged; resume from an earlier one$"),
    ("train.resume", damaged_checkpoint(lambda p: (p / store.rank_file(0)).unlink()),
     r"rank_00000\.pt is missing \(its checksums\.json lists it\): the checkpoint is damaged"),
    ("train.resume", damaged_checkpoint(lambda p: (p / store.CHECKSUMS_FILE).write_text(
        '{"algorithm": "sha256", "files": {"../../x": "00"}}')),
     r"its checksums\.json names '\.\./\.\./x' leaves the checkpoint \('\.\.'\); a checkpoint reads only "
     r"files inside its own directory"),
    ("train.resume", damaged_checkpoint(symlinked_out),
     r"its entry 'model\.safetensors' leaves the checkpoint \(a symlink to .*outside\.safetensors\)"),
    ("data.val_urls", crafted_val_shard("neg.tar", lambda: NEGATIVE["pax header"]),  # looped for good
     r"neg\.tar: cannot read shard \(after sample 'a'\): TarFormatError: \./\./@PaxHeader: a negative size "
     r"\(-3584\) in its header: a damaged or crafted shard"),
    ("data.val_urls", crafted_val_shard("negm.tar", lambda: NEGATIVE["member"]),  # an "empty document"
     r"negm\.tar: cannot read shard \(before its first sample\): TarFormatError: a\.txt: a negative size"),
    ("data.val_urls", crafted_val_shard("huge.tar", lambda: with_size(PLAIN[:512], 7 * 10**9)
                                        + PLAIN[512:]),  # issue 46: a MemoryError
     r"huge\.tar: cannot read shard \(before its first sample\): TarFormatError: a\.txt: its header says "
     r"7,000,000,000 bytes but the file has [\d,]+ left: a truncated or damaged shard"),
    ("data.path", damaged_ids(forged_out_of_vocabulary),
     r"train-000000\.tar: sample '[^']+': its stored ids hold 60000, outside the vocabulary \(512 tokens\) "
     r"of the tokenizer the manifest says encoded them; the shard is damaged"),
    ("data.path", damaged_ids(written_as_uint32),  # issue 46: trained silently
     r"its ids read as <u4 values \(every second <u2 value is 0: written as uint32\), but the manifest says "
     r"<u2"),
    ("data.path", damaged_ids(whitespace_text), r"train-000000\.tar: sample '[^']+' is an empty document"),
    ("hydra.run.dir", users_own_files, r"hydra.run.dir .*/mine holds files that no run wrote \(thesis.tex\)"),
    ("train.eval_tasks", unknown_eval_task,
     r"train.eval_tasks .*/missing.jsonl: no such task file, nor a built-in task \(continuation4, cloze\)"),
    ("seed", resumed_with("seed=1"),
     r"cannot resume from .*step_000003: it was written with seed=0 and this run has seed=1"),
    ("train.seq_len", resumed_with("train.seq_len=256", "train.tokens_per_step=1024"),
     r"written with train.seq_len=128, model.max_seq_len=128 and this run has train.seq_len=256, "
     r"model.max_seq_len=256"),
    ("data.shuffle_buffer", resumed_with("data.shuffle_buffer=8"),
     r"data.shuffle_buffer=64 and this run has "),
    # issue 46: was ignored
    ("data.loss_on", resumed_with("data.loss_on=assistant"),
     r"it was written with data.loss_on=all and this run has data.loss_on=assistant"),
    ("model.n_layer", resumed_with("model=small", "model.max_seq_len=128"),
     r"model.n_layer=2, model.n_head=4, model.n_embd=64 and this run has model.n_layer=6, model.n_head=6, "
     r"model.n_embd=384; resume with the checkpoint's values"),
    ("world_size", missing_rank_file,
     r"rank_00001.pt is missing: the checkpoint is damaged \(it was written by 2 ranks\)"),
    ("data.epoch_lockstep", reshaped_without_lockstep,
     r"resumes on another number of ranks or DataLoader workers only with data.epoch_lockstep=true"),
    ("data.sources", reshaped_mixture,
     r"the checkpoint's data stream mixes the sources \['code', 'prose'\]; this run "
     r"reads one source: resume with the checkpoint's data config"),
    ("data.sources", one_source_state_into_a_mixture,
     r"the checkpoint's data stream is one source; this run mixes \['a', 'b'\] \(data.sources\)"),
    ("data.sources", mixture_state_into_one_source,
     r"the checkpoint's data stream mixes the sources \['a', 'b'\]; "
     r"this run reads one source: resume with the checkpoint's data"),
    ("train.resume", damaged_meta('{"step": 3, "world'),
     r"meta.json is not valid JSON .*the checkpoint is damaged"),
    ("train.resume", damaged_meta("[1, 2]"), r"meta.json is not a packtrain checkpoint's meta"),
    ("train.resume", damaged_meta('{"step": 3, "world_size": 2, "parallel": {"context": 4, "tensor": 1}}'),
     r"meta.json: its writer's context x tensor sizes 4 x 1 do not tile its world_size 2: the checkpoint is "
     r"damaged"),
    ("train.resume", damaged_meta('{"step": 3, "world_size": 2, "parallel": [2]}'),
     r"meta.json: its 'parallel' is not an object of context and tensor sizes"),
    ("train.resume", damaged_conventions("[]"), r"conventions.json: not a JSON object \(got list\)"),
    ("train.resume", damaged_conventions("{}"), r"conventions.json holds no tokenizer sha256 and vocab_size"),
    ("train.resume", damaged_conventions("{"), r"conventions.json: unreadable"),
    ("train.resume", numeric_resume, r"123 is not a packtrain checkpoint \(no meta.json\)"),
    ("report", report_of(""), r"config.json: not valid JSON"),
    ("report", report_of("[1, 2]"), r"config.json: holds a JSON list, not an object"),
    ("report", report_of("{}", "--tolerance", "nan"), r"--tolerance must be a finite number >= 0, got nan"),
    ("generate", command_main(generate.main, "{tmp}/x", "--prompt", "a", "--temperature", "nan"),
     r"--temperature a finite number >= 0, got .* nan"),
    ("generate", command_main(generate.main, "{tmp}/x", "--prompt", "a", "--device",
                              "cuda" if not torch.cuda.is_available() else "cuda:999"),
     r"--device cuda.*(no CUDA device is visible|CUDA device\(s\))"),
    ("generate", command_main(generate.main, "{tmp}/x", "--prompt", "a", "--device", "gpu0"),
     r"--device 'gpu0' is not a torch device"),
    ("inspect_mask", command_main(inspect_mask.main, "--text", "a|b", "--sep", "", "--out", "{tmp}/out"),
     r"--sep is empty"),
    ("inspect_mask", into_a_dataset, r"--out .*/dataset is a prepared dataset \(manifest.json\)"),
    ("inspect_mask", over_a_users_page, r"--out .*/mine holds a mask.html that inspect_mask did not write"),
    ("inspect_mask", inside_a_runs_checkpoints,
     r"--out .*/run/checkpoints is inside .*/run, which is a training run's dir \(metrics.jsonl\)"),
    ("prepare", command_main(prepare.main, "--source", "demo", "--out", "{tmp}/out", "--add-tokens", ""),
     r"--add-tokens \[''\]: each token must be a non-empty string"),
    ("prepare", command_main(prepare.main, "--source", "demo", "--out", "{tmp}/out", "--unit-mb", "nan"),
     r"--unit-mb must be a finite number > 0, got nan"),
    ("prepare", command_main(prepare.main, "--source", "demo", "--out", "{tmp}/out", "--unit-mb", "inf"),
     r"--unit-mb must be a finite number > 0, got inf"),
    ("prepare", command_main(prepare.main, "--source", "demo", "--out", "{tmp}/out", "--tokenizer-sample-mb",
                             "nan"),
     r"--tokenizer-sample-mb must be a finite number > 0, got nan"),
    ("prepare", hf_tokenizer_prepare(config_text="{"),
     r"tok/tokenizer_config\.json: not a readable JSON file"),
    ("prepare", hf_tokenizer_prepare(config_text="[]"),
     r"tok/tokenizer_config\.json: holds a JSON list, expected an"),
    ("prepare", hf_tokenizer_prepare(eos_token="<|nope|>"),
     r"tok/tokenizer_config\.json: eos_token '<\|nope\|>' is not in the vocabulary of tokenizer\.json"),
    ("prepare", hf_tokenizer_prepare(eos_token=5),
     r"tokenizer_config\.json: eos_token is 5, expected a token string"),
    ("prepare", hf_tokenizer_prepare(add_bos_token="yes"), r"add_bos_token is 'yes', expected true or false"),
    ("prepare", hf_tokenizer_prepare(post_processor=f"$A {LLAMA3[1]}"),
     r"tok/tokenizer\.json: its post-processor adds special tokens other than a BOS at the start"),
    ("prepare", hf_tokenizer_prepare(add_bos_token=False),
     r"tokenizer_config\.json: add_bos_token is false, but the post-processor of tokenizer\.json adds "
     r"'<\|begin_of_text\|>' at the start"),
    ("prepare", hf_tokenizer_prepare(post_processor=None, bos_token=None, add_bos_token=True),
     r"tokenizer_config\.json: add_bos_token is true but no bos_token is set"),
    ("prepare", hf_tokenizer_prepare("demo-chat"),
     r"tok/tokenizer\.json: chat data needs the ChatML tokens "
     r"\['<\|im_start\|>', '<\|im_end\|>'\], which this tokenizer lacks"),
    ("prepare", command_main(prepare.main, "--source", "demo", "--out", "{tmp}/out", "--workers", "0"),
     r"--workers must be >= 1, got 0"),
    ("prepare", command_main(prepare.main, "--merge", "{tmp}/out", "--source", "demo", "--out",
                             "{tmp}/other"),
     r"--merge .*/out merges the parts staged for that dataset and takes no --source or --out"),
    ("data.on_error", unreadable_val_shard, r"the eval read no document from its 1 held-out shard\(s\) .*"
                                              r"data.on_error=skip skipped what it could not read"),
    ("export", edited_checkpoint(nan_in(store.WEIGHTS_FILE, "wte.weight")),  # issue 54: wrote garbage, exit 0
     r"step_000003/model\.safetensors: tensor wte\.weight holds NaN values: the checkpoint's weights are "
     r"damaged"),
    ("generate", edited_export(nan_in("model.safetensors", "transformer.h.0.mlp.c_fc.weight", math.inf)),
     r"hf/model\.safetensors: tensor transformer\.h\.0\.mlp\.c_fc\.weight holds inf values: the weights are "
     r"damaged"),
    # a MemoryError
    ("generate", edited_export(json_edit("config.json", lambda c: c.update(n_layer=1_000_000))),
     r"hf/config\.json: describes a model of [\d,]+ parameters \(1,000,000 layers, .* but its weights \(.*"
     r"model\.safetensors\) hold [\d,]+: the config does not describe these weights"),
    ("export", edited_checkpoint(json_edit(store.META_FILE,
                                           lambda m: m["config"]["model"].update(n_layer=10**6))),
     r"step_000003/meta\.json: describes a model of [\d,]+ parameters \(1,000,000 layers.*refused before "
     r"building"),
    ("generate", edited_checkpoint(json_edit(store.META_FILE,
                                             lambda m: m["config"]["model"].update(n_embd=6400)),
                                   command="generate"),
     r"meta\.json: describes a model of [\d,]+ parameters .*width 6,400"),
    # replaced the weights, exit 0
    ("evaluate", out_into("evaluate", copied("checkpoint", store.WEIGHTS_FILE)),
     r"--out .*copy/model\.safetensors is inside .*/copy, which is a checkpoint \(meta\.json\): "
     r"give a path of its own"),
    ("evaluate", out_into("evaluate", users_file("notes.json")),
     r"--out .*notes\.json exists and is not an earlier output of trainer\.evaluate: it would be "
     r"overwritten; give another path, or --overwrite to replace it"),
    ("harness", out_into("harness", copied("demo_data", "tokenizer", "scores.json")),
     r"--out .*copy/tokenizer/scores\.json is inside .*/copy/tokenizer, which is a tokenizer "
     r"\(tokenizer\.json\)"),
    ("report", out_into("report", a_run_dir), r"--out .*runs/a is a training run's dir \(metrics\.jsonl\)"),
    ("report", out_into("report", a_foreign_report),
     r"--out .*/mine holds a report\.html that trainer\.report did not write: it would be overwritten"),
    ("train.resume", damaged_checkpoint(unlisted(store.ENGINE_FILE)),  # resumed with exit 0, NaN a step later
     r"engine\.pt is not listed in its checksums\.json \(every file of a checkpoint is\): the checkpoint is "
     r"damaged"),
    ("train.resume", damaged_checkpoint(lambda p: (p / store.CHECKSUMS_FILE).write_text(
        '{"algorithm": "sha256", "files": {}}')),
     r"checksums\.json lists no files: the checkpoint is damaged"),
    ("train.resume", damaged_checkpoint(lambda p: (p / store.CHECKSUMS_FILE).unlink()),  # loaded unverified
     r"checksums\.json is missing \(its meta\.json says it was written\): the checkpoint is damaged"),
    ("evaluate", task_file_row(b'{"query": "q", "choices": ["a", "b"], "gold": 0, "gold": 1}\n'),
     r"task\.jsonl:1: key 'gold' appears twice in one object"),
    ("evaluate", task_file_row(b'{"query": "q\\ud800", "choices": ["a", "b"], "gold": 0}\n'),  # a traceback
     r"task\.jsonl:1: query holds a lone surrogate"),
    ("evaluate", task_file_row(b'{"query": ' + b"[" * 200_000 + b"]" * 200_000 + b"}\n"),  # a RecursionError
     r"task\.jsonl:1: JSON nested too deeply to read"),
    ("generate", edited_export(json_edit("config.json", lambda c: c.update(n_head=-4))),  # named head_dim
     r"hf/config\.json: n_head must be a positive integer, got -4"),
    ("launcher", command_main(launcher.main, "--nproc_per_node=two", "-m", "trainer.train"),
     r"--nproc_per_node must be a number of processes >= 1 or one of auto, cpu, gpu, xpu; got 'two'"),
    ("prepare", prepared_into_a_checkpoint,
     r"--out .*ckpt/data is inside .*/ckpt, which is a checkpoint \(meta\.json\): give a directory of its "
     r"own"),
    # lm-eval's own traceback
    ("harness", command_main(harness.main, "{tmp}/x", "--tasks", "a", "--limit", "-1"),
     r"--limit and --batch-tokens must be >= 1, got -1 and 8192"),
    ("export", out_into("export", copied("demo_data", "hf")),
     r"--out .*copy/hf is inside .*/copy, which is a prepared dataset \(manifest\.json\): give a directory "
     r"of its "),
]


@pytest.mark.parametrize("key, call, message", CALL_ROWS,
                         ids=[f"{i}-{r[0]}" for i, r in enumerate(CALL_ROWS)])
def test_a_bad_checkpoint_resume_or_argument_is_one_error_line(hydra_configs, capsys, tmp_path, request, key,
                                                               call, message):
    for name in getattr(call, "fixtures", ()):
        request.getfixturevalue(name)
    capsys.readouterr()
    status = run_command(lambda: call(tmp_path, request.getfixturevalue), message=user_message)
    line = assert_one_error_line(status, capsys.readouterr().err)
    assert re.search(message, line), (message, line)
    assert not (tmp_path / "out").exists() and not (tmp_path / "report").exists()


def test_nan_losses_at_the_same_steps_are_not_called_the_same_objective():
    def run(name: str, losses: list[float]) -> report_runs.Run:
        return report_runs.Run(name, Path(name), {"loss.normalization": "global_tokens"},
                          [{"step": i + 1, "loss": x} for i, x in enumerate(losses)], None, [])

    ref, other = run("a", [3.0, math.nan, math.nan]), run("b", [3.0, math.nan, math.nan])
    verdict = report_verdicts.same_objective_verdict(other, ref, ["data.prefetch"], 1e-4)
    assert verdict.startswith("not comparable: non-finite loss at 2 shared step(s) (first: step 2)"), verdict
    assert report_verdicts.same_objective_verdict(run("c", [3.0, 2.5]), run("d", [3.0, 2.5]), [],
                                                  1e-4).startswith("same objective")


# ---------------------------------------------------------------------------------------------------
# COMMAND_ROWS: real subprocesses, side by side
# ---------------------------------------------------------------------------------------------------

COMMAND_ROWS: dict[str, tuple[str, list[str], str, str | None]] = {
    # name -> (config key or command, python -m argv ({tmp}: the row's directory), regex of the line, what
    # stays intact)
    "context_parallel_over_one_rank": ("distributed.context_parallel", ["trainer.train", *SMALL,
                                       "distributed.context_parallel=2", "hydra.run.dir={tmp}/run"],
                                       r"distributed.context_parallel=2 must divide the number of ranks "
                                       r"\(1\)", None),
    "n_head_0": ("model.n_head", ["trainer.train", *SMALL, "model.n_head=0", "hydra.run.dir={tmp}/run"],
                 r"^error: model.n_head must be >= 1, got 0$", None),
    "zero_stage_under_ddp": ("distributed.zero_stage", ["trainer.train", *SMALL, "distributed.zero_stage=1",
                                                        "hydra.run.dir={tmp}/run"],
                             r"distributed.zero_stage exists only with distributed.engine=deepspeed", None),
    "run_dir_is_a_file": ("hydra.*", ["trainer.train", *SMALL, "hydra.run.dir={tmp}/a_file"],
                          r"cannot create the run directory .*a_file.*hydra.run.dir .* must name a directory",
                          "a_file"),
    "resume_with_another_seed": ("seed", ["trainer.train", *SMALL, "seed=1", "train.resume={tmp}/ckpt/"
                                          "checkpoints/step_000003", "hydra.run.dir={tmp}/run"],
                                 r"cannot resume from .*: it was written with seed=0 and this run has seed=1",
                                 "ckpt"),
    "resume_another_runs_checkpoint_into_a_used_run_dir": (
        "train.resume", ["trainer.train", *SMALL, "train.resume={tmp}/ckpt/checkpoints/step_000003",
                         "hydra.run.dir={tmp}/runs/r"],
        r"runs/r already holds a run \(metrics.jsonl, config.json\) and "
        r"train.resume=.*ckpt/checkpoints/step_000003 is another run's checkpoint: resume it in another "
        r"hydra.run.dir, or with train.overwrite=true",
        "runs/r/metrics.jsonl"),
    "overwrite_and_resume_own_checkpoint": (
        "train.overwrite", ["trainer.train", *SMALL, "train.overwrite=true",
                            "train.resume={tmp}/ckpt/checkpoints/step_000003", "hydra.run.dir={tmp}/ckpt"],
        r"train.overwrite=true would move .*step_000003 aside with the rest of the run it continues",
        "ckpt/checkpoints"),
    "generate_temperature_nan": ("generate", ["trainer.generate", "{tmp}/ckpt/checkpoints/step_000003",
                                              "--prompt", "x", "--temperature", "nan"],
                                 r"--temperature a finite number", "ckpt"),
    "report_empty_config": ("report", ["trainer.report", "{tmp}/runs", "--out", "{tmp}/report"],
                            r"config.json: not valid JSON", "runs"),
    "inspect_mask_empty_sep": ("inspect_mask", ["trainer.inspect_mask", "--text", "a|b", "--sep", "", "--out",
                                                "{tmp}/out"], r"--sep is empty", None),
}

def tree_digest(path: Path) -> str:
    """A digest of every file under `path` (or of the file itself): names and contents."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(path.parent)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def command_results(hydra_configs, tmp_path_factory) -> dict[str, tuple]:
    """name -> (exit status, stderr, digest of what must be intact before, after, the row's directory)."""
    config = composed()
    rows, train_cases, procs = {}, {}, {}
    for name, (_, argv, _, intact) in COMMAND_ROWS.items():
        tmp = tmp_path_factory.mktemp(name)
        (tmp / "a_file").write_text("not a directory\n")
        fake_checkpoint(tmp / "ckpt", {"step": 3, "world_size": 1, "config": config})
        (tmp / "runs" / "r").mkdir(parents=True)
        (tmp / "runs" / "r" / "config.json").write_text("")
        (tmp / "runs" / "r" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
        rows[name] = (tmp, tree_digest(tmp / intact) if intact else None)
        args = [a.replace("{tmp}", str(tmp)) for a in argv]
        if args[0] == "trainer.train":
            train_cases[name] = args[1:]
        else:  # side by side with the train driver
            procs[name] = subprocess.Popen([sys.executable, "-m", *args], cwd=tmp, env=ENV,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    out = tmp_path_factory.mktemp("train_driver") / "results.json"
    driver = subprocess.run([sys.executable, "-c", TRAIN_CLI_DRIVER, json.dumps(list(train_cases.values())),
                             str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert driver.returncode == 0, driver.stderr[-5000:]
    results = dict(zip(train_cases, map(tuple, json.loads(out.read_text())), strict=True))
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=120)
        results[name] = (proc.returncode, stderr)
    out = {}
    for name, (tmp, digest) in rows.items():
        intact = COMMAND_ROWS[name][3]
        out[name] = (*results[name], digest, tree_digest(tmp / intact) if intact else None, tmp)
    return out


@pytest.mark.parametrize("name", list(COMMAND_ROWS))
def test_a_real_command_ends_a_mistake_with_one_line_and_exit_2(command_results, name):
    code, stderr, before, after, tmp = command_results[name]
    line = assert_one_error_line(code, stderr)
    assert re.search(COMMAND_ROWS[name][2], line), (COMMAND_ROWS[name][2], line)
    assert before == after, f"{COMMAND_ROWS[name][3]} changed"
    assert not (tmp / "out").exists() and not (tmp / "report").exists()
    run_dir = tmp / "run"  # Hydra makes it before the job; the job wrote nothing into it
    assert not run_dir.exists() or {p.name for p in run_dir.iterdir()} <= {".hydra", "train.log"}


def _as_from_a_terminal() -> None:
    """In the child before exec: SIGINT as a terminal's foreground job has it (default action, not blocked),
    whatever an earlier test in this pytest worker left (an ignored or blocked signal survives exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def test_ctrl_c_ends_a_training_run_with_one_line_and_its_checkpoints_intact(demo_data, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.train", f"data.path={demo_data}", f"hydra.run.dir={run_dir}",
           *SMALL, "train.max_steps=100000", "train.checkpoint_every=1", "train.eval_every=0",
           "train.keep_last=1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # its own process group: Ctrl-C reaches the workers too
                            preexec_fn=_as_from_a_terminal)
    deadline = time.monotonic() + 90
    while (store.latest_checkpoint(run_dir) is None
           or store.latest_checkpoint(run_dir).name < store.step_name(2)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        # hung: its threads' stacks (trainer.train dumps them on SIGQUIT), then kill
        os.kill(proc.pid, signal.SIGQUIT)
        time.sleep(3)
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"the run did not end within 60 s of SIGINT; its stacks:\n{stderr[-12000:]}")
    assert proc.returncode == EXIT_INTERRUPTED, stderr
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert re.match(r"error: interrupted \(SIGINT\): training stopped during step \d+; nothing after step "
                    r"\d+ was saved \(last checkpoint: .*step_\d+\); continue with train.resume=true",
                    lines[0]), lines[0]
    last = store.latest_checkpoint(run_dir)
    assert store.read_meta(last)["step"] >= 2 and (last / store.WEIGHTS_FILE).is_file()  # complete, loadable


# ---------------------------------------------------------------------------------------------------
# The table covers every config key
# ---------------------------------------------------------------------------------------------------


def test_every_config_key_has_a_bad_input_row():
    covered = ({key for key, _, _ in CONFIG_ROWS} | {key for key, _, _ in CALL_ROWS}
               | {row[0] for row in COMMAND_ROWS.values()})
    missing = sorted(set(CONFIG_KEYS) - covered)
    assert missing == [], f"add a row with an invalid value of each new config key: {missing}"
    for key, overrides, _ in CONFIG_ROWS:  # each config row sets the key it is filed under (or a group of it)
        assert key == "hydra.*" or any(o.split("=")[0] in (key, key.split(".")[0]) for o in overrides), key
