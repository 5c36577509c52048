# Two commands for a fresh machine: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch. On a CUDA machine: make TORCH_SPEC='torch>=2.5' ...
TORCH_SPEC ?= torch==2.13.0
DEMO_DATA  ?= data/demo
DEMO_SWEEP := runs/demo/$(shell date +%Y-%m-%d_%H-%M-%S)
CHAT_DATA  ?= data/demo-chat
MIX_SWEEP  := runs/mixture/$(shell date +%Y-%m-%d_%H-%M-%S)
SFT_RUN    := runs/sft/$(shell date +%Y-%m-%d_%H-%M-%S)

.PHONY: install demo mixture sft test lint clean
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) -m pip install -q -e '.[dev]'
# DeepSpeed (the `deepspeed` extra; CI runs its tests) is a source package built against the torch above,
# hence no build isolation. DS_BUILD_OPS=0: no compiled ops (a GPU machine JIT-builds those it uses; on CPU
# the engine skips the shared-memory kernel and uses plain gloo).
	DS_BUILD_OPS=0 PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) -m pip install -q --no-build-isolation 'deepspeed>=0.15'
	touch $@

# Prepare the demo corpus once (the standard library's own source), show the packing report, train the tiny
# model packed and unpacked on the same documents, and write the ablation report.
demo: install
	@test -f $(DEMO_DATA)/manifest.json || $(PY) -m trainer.prepare --source demo --out $(DEMO_DATA) --docs-per-shard 500
	$(PY) bench/packing.py --from-shards $(DEMO_DATA) --seq-len 512
	$(PY) -m trainer.train -m experiment=demo data.path=$(DEMO_DATA) hydra.sweep.dir=$(DEMO_SWEEP)
	$(PY) -m trainer.report $(DEMO_SWEEP)
	@echo "report: $(DEMO_SWEEP)/report.html (and report.md)"

# A data mixture of two sources cut from the same corpus: the demo's functions and classes (data/demo) and whole
# modules (data/demo-modules, prepared here with the demo's tokenizer), weighted 0.7/0.3 and 0.3/0.7, each packed
# and unpacked; the report compares the loss per source and the token shares with the weights. The preset
# (configs/experiment/mixture_ablation.yaml) names both directories.
mixture: install
	@test -f data/demo/manifest.json || $(PY) -m trainer.prepare --source demo --out data/demo --docs-per-shard 500
	@test -f data/demo-modules/manifest.json || $(PY) -m trainer.prepare --source demo-modules --out data/demo-modules \
		--tokenizer data/demo/tokenizer --docs-per-shard 100
	$(PY) -m trainer.train -m experiment=mixture_ablation hydra.sweep.dir=$(MIX_SWEEP)
	$(PY) -m trainer.report $(MIX_SWEEP)
	@echo "report: $(MIX_SWEEP)/report.html (and report.md)"

# After `make demo`: fine-tune its packed checkpoint on chat data built from the same corpus (questions about
# stdlib functions answered from their docstrings), loss on the assistant's turns only; export the result to the
# Hugging Face format and answer a question with it.
sft: install
	@ckpt=$$(ls -d runs/demo/*/0_layout=packed/checkpoints/step_* 2>/dev/null | sort | tail -1); \
	test -n "$$ckpt" || { echo "error: no demo checkpoint under runs/demo: run make demo first" >&2; exit 2; }; \
	set -e; \
	test -f $(CHAT_DATA)/manifest.json || $(PY) -m trainer.prepare --source demo-chat --out $(CHAT_DATA) \
		--tokenizer $$ckpt/tokenizer; \
	$(PY) -m trainer.train experiment=sft data.path=$(CHAT_DATA) "train.init_from='$$ckpt'" hydra.run.dir=$(SFT_RUN); \
	$(PY) -m trainer.export $$(ls -d $(SFT_RUN)/checkpoints/step_* | tail -1) --out $(SFT_RUN)/hf; \
	$(PY) -m trainer.generate $(SFT_RUN)/hf --chat --prompt "What does json.dumps do?" --max-new-tokens 60
	@echo "fine-tuned model (Hugging Face format): $(SFT_RUN)/hf"

# Two pytest workers, each given whole test files (module fixtures are built once), one thread per process:
# ~14-20 min on 2 shared cores (clean clones, bash .ci/run, 2026-12-02: 1,233 passed, 35 skipped in 14m30s and
# 19m38s for the same tree, the machine's speed varying; +2-3 min install).
# TEST_WORKERS=0 runs them in one process.
TEST_WORKERS ?= 2
test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

lint: install
	$(PY) -m ruff check trainer tests bench scripts

clean:
	rm -rf $(VENV) data runs outputs
