# Two entry points for a newcomer: `make demo` and `make test`. Everything else is a helper.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
# Apache Kafka's jars, resolved once with Maven (deploy/kafka/pom.xml) into the user's cache folder.
KAFKA_VERSION := $(shell sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' deploy/kafka/pom.xml)
KAFKA_LIBS    := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/deepanalyze/kafka-$(KAFKA_VERSION)/libs
KAFKA_STAMP   := $(KAFKA_LIBS)/.resolved-$(shell sha1sum deploy/kafka/pom.xml | cut -c1-12)
# llama.cpp's llama-server, the OpenAI-compatible server the ANALYZER_BACKEND=openai tests run against.
LLAMA_SERVER  := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/deepanalyze/llama-server-0.3.36/bin/llama-server

.PHONY: install model-large llama-server demo test lint typecheck unit schemas bench bench-full bench-engine bench-validity bench-kv bench-pipeline bench-faults clean bench-cuda bench-peers bench-probe bench-guard

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[model,dev]'
	# xgrammar declares triton (1 GB of GPU kernels) as a dependency on Linux x86_64; its CPU path
	# never uses it, so on CPU machines install xgrammar and its two real dependencies without it.
	# The CUDA image installs the `grammar` extra normally (triton comes with CUDA torch anyway).
	$(BIN)/pip install --quiet --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	# Docker Compose v2 for the offline `docker compose config` check of deploy/ (checksummed binary).
	$(BIN)/python .ci/fetch-compose $(BIN)/docker-compose
	# Debian's Chromium and a CJK font for the browser tests of the pages.
	.ci/install-browser
	rm -f $(VENV)/.installed-*
	touch $@

$(KAFKA_STAMP): deploy/kafka/pom.xml
	@if command -v mvn >/dev/null && command -v java >/dev/null; then \
	  echo "resolving Apache Kafka $(KAFKA_VERSION) into $(KAFKA_LIBS)"; \
	  rm -rf $(KAFKA_LIBS) && \
	  mvn -q -B -f deploy/kafka/pom.xml dependency:copy-dependencies -DincludeScope=runtime \
	    -DoutputDirectory=$(KAFKA_LIBS) && touch $@; \
	else \
	  echo "Java or Maven not found: no Apache Kafka; the demo and the tests fall back to the Tansu emulator"; \
	fi

install: $(STAMP) $(KAFKA_STAMP)

# Built once (about 5 minutes on 2 cores) from the pinned llama-cpp-python sdist's llama.cpp tree.
$(LLAMA_SERVER):
	@if command -v cmake >/dev/null && command -v ninja >/dev/null; then \
	  echo "building llama-server into $(dir $(LLAMA_SERVER)) (once)"; \
	  .ci/build-llama-server $(dir $(LLAMA_SERVER)).. ; \
	else \
	  echo "cmake or ninja not found: no llama-server; the ANALYZER_BACKEND=openai end-to-end tests skip"; \
	fi

llama-server: install $(LLAMA_SERVER)

# The larger bundled model (MODEL=qwen2.5-coder-1.5b): its 22 pinned wheels, about 1.1 GB.
model-large: install
	$(BIN)/pip install --quiet -e '.[model-large]'

demo: install
	$(BIN)/deepanalyze demo

test: install llama-server lint typecheck
	LLAMA_SERVER=$(LLAMA_SERVER) $(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

unit: install
	$(BIN)/python -m pytest -m "not integration and not model"

bench-engine: install
	$(BIN)/python -m bench.engine_bench --out bench/results/engine.json

bench-kv: install
	$(BIN)/python -m bench.kv_quality --out bench/results/kv-quality.json

bench-pipeline: install
	$(BIN)/python -m bench.pipeline_bench --out bench/results/pipeline.json

# Faults on a 3-node Apache Kafka cluster (leader kills, a broker restart, worker kills, a
# rebalance), at-least-once and exactly-once, with the stand-in analyser: lost and duplicates.
bench-faults: install
	$(BIN)/python -m bench.kafka_faults --out bench/results/kafka-faults.json

# Our engine beside vLLM's CPU build and llama.cpp's server, same workload, same run: builds their
# environments under .peers/ first (bench/peers_setup.sh: a few GB of downloads, ~10 minutes once).
bench-peers: install
	bash bench/peers_setup.sh
	$(BIN)/python -m bench.peers --rounds 3 --out bench/results/peers-cpu.json

# On a GPU host (CUDA torch on its python3): engine tests on CUDA + the 8B-shaped engine benchmark.
# `bench/cuda_prepare.sh`, run where PyPI answers, puts the wheels and tokenizer it needs in .cuda/.
bench-cuda:
	bash bench/cuda_check.sh

bench: install
	$(BIN)/python -m bench.load_test --profile quick --out-dir bench/results/load

bench-full: install
	$(BIN)/python -m bench.load_test --profile full --out-dir bench/results/load-full

bench-probe: install
	$(BIN)/python -m bench.probe --report bench/results/probe.json

bench-quality: install
	$(BIN)/python -m bench.quality --out bench/results/quality.json

bench-injection: install
	$(BIN)/python -m bench.injection --out bench/results/injection.json

bench-guard: install
	$(BIN)/python -m bench.guard --out bench/results/guard-dev.json

bench-validity: install
	$(BIN)/python -m bench.validity --out bench/results/validity.json

schemas: install
	$(BIN)/python -m schemas.export

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache test-artifacts
