# Everything runs from the virtual environment in .venv (created on first use).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: install demo test bench clean

install: $(STAMP)

# torch first, pinned to the CPU build on this disk; then the project, editable, with dev extras.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The main job: a small GPT-style LM on the embedded corpus (prepared once into
# ~/.cache/shardlm); valid perplexity falls within about two minutes on 2 CPU cores.
demo: install
	$(VENV)/bin/train --arch transformer_lm_gpt2_tiny --decoder-layers 4 --decoder-embed-dim 128 \
		--decoder-ffn-embed-dim 512 --decoder-attention-heads 4 --dropout 0 --attention-dropout 0 \
		--share-decoder-input-output-embed --tokens-per-sample 128 --batch-size 16 \
		--optimizer adam --adam-betas "(0.9, 0.98)" --lr 0.002 --lr-scheduler inverse_sqrt \
		--warmup-updates 100 --clip-norm 1.0 --max-update 600 --validate-interval-updates 50 \
		--log-format simple --log-interval 50 --save-dir checkpoints/demo

test: install
	$(PY) -m pytest -q -rs tests

bench: install
	$(PY) bench/bench_loop.py

clean:
	rm -rf $(VENV) checkpoints
