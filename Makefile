# Everything runs from the virtual environment in .venv (created on first use), installed in
# two steps, each with its stamp: the runtime (pyproject's dependencies: what `make demo` and
# the commands need), then the dev extras (pytest, ruff, transformers, trl, lm-eval, openai,
# wandb: what `make test`, `make lint` and the benchmarks need). `make install` is both.
VENV    := .venv
PY      := $(VENV)/bin/python
RUNTIME := $(VENV)/.installed-stamp
DEV     := $(VENV)/.dev-installed-stamp

.PHONY: install demo test lint bench soak clean

install: $(RUNTIME) $(DEV)

# torch first, pinned to the CPU build on this disk; then the project, editable.
$(RUNTIME): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	touch $@

# The dev extras, over the runtime (again whenever pyproject.toml changes, as the runtime is).
$(DEV): $(RUNTIME)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# The main job: a small GPT-style LM on the embedded corpus (prepared once into
# ~/.cache/shardlm), sharded with FSDP over 2 local ranks (8 sequences each per update);
# valid perplexity falls to near the corpus's floor in a few minutes on 2 CPU cores; then the
# best checkpoint is evaluated on the test split and sampled from. Run again, it resumes from
# checkpoints/demo/checkpoint_last (nothing left to train); `make clean` starts over.
demo: $(RUNTIME)
	$(VENV)/bin/train --ddp-backend fully_sharded --distributed-world-size 2 \
		--arch transformer_lm_gpt2_tiny --decoder-layers 4 --decoder-embed-dim 128 \
		--decoder-ffn-embed-dim 512 --decoder-attention-heads 4 --dropout 0 --attention-dropout 0 \
		--share-decoder-input-output-embed --tokens-per-sample 128 --batch-size 8 \
		--optimizer adam --adam-betas "(0.9, 0.98)" --lr 0.002 --lr-scheduler inverse_sqrt \
		--warmup-updates 100 --clip-norm 1.0 --max-update 600 --validate-interval-updates 50 \
		--log-format simple --log-interval 50 --save-dir checkpoints/demo
	$(VENV)/bin/eval-lm --path checkpoints/demo/checkpoint_best --gen-subset test --batch-size 16
	$(VENV)/bin/generate --path checkpoints/demo/checkpoint_best --prompt "ravulili zazu" --prompt "lapa" \
		--max-new-tokens 24 --top-k 10 --seed 1

test: $(DEV)
	$(PY) -m pytest -q -rs --durations=15 tests

# ruff's checks and its formatter's check (the rules: [tool.ruff] in pyproject.toml); `.ci/run`
# runs it before the tests. `$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .` fixes most.
lint: $(DEV)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Every benchmark script in turn (each prints its tables), then one table of goals met or
# not, all written to docs/benchmarks.md with the date, host and commit. Run on a quiet
# machine: each compares contenders interleaved in one run, medians.
bench: install
	$(PY) bench/run_all.py

# 2,000 updates of the tiny model on 2 FSDP ranks with a checkpoint every 100 (keep 3), then
# the same without checkpoints: RSS and open fds per rank stay flat, retention holds, the
# loss curves are identical. About 10 minutes on 2 cores; not part of `make bench`.
soak: install
	$(PY) bench/soak.py

clean:
	rm -rf $(VENV) checkpoints
