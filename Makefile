# shardstate: the two commands that matter are `make demo` and `make test`.
# Both set up everything they need on a fresh machine: `make demo` a
# virtualenv in .venv (torch==2.13.0, numpy, pytest, hypothesis, zstandard;
# fsspec, s3fs, moto[server] and safetensors for the storage tests) and the
# in-place extension; `make test` a wheel of this tree installed into
# build/wheel-venv (the same dependencies), tested as users install it.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.deps-stamp
export PYTHONPATH := $(CURDIR)/python

CC      ?= gcc
CFLAGS_C := -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-missing-field-initializers -O1 -g -pthread \
            -Icsrc/core -Itests/c
CORE_SRC := $(sort $(wildcard csrc/core/*.c))
CTESTS   := $(patsubst tests/c/%.c,build/ctest/%,$(sort $(wildcard tests/c/test_*.c)))
# libstdc++ is preloaded beside libasan: without it a C++ exception thrown
# inside torch aborts the process under the ASan runtime.
LIBASAN   = $(shell $(CC) -print-file-name=libasan.so) $(shell $(CC) -print-file-name=libstdc++.so)

.PHONY: all venv build test wheel-test check lint ctest tsan-ctest asan-test demo bench bench-planning bench-fsspec clean

all: build

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "torch==2.13.0" "numpy>=1.23" "pytest>=7" "hypothesis>=6" "setuptools>=77" \
	    "zstandard>=0.22" wheel \
	    "fsspec>=2023.1" "s3fs>=2023.1" "moto[server]>=5" "safetensors>=0.4" "tqdm>=4.60"
	touch $@

venv: $(STAMP)

build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace

# The whole pytest suite against the package as users install it: a wheel
# built from this tree (pip's isolated build), installed into its own
# virtualenv (made once, with the test dependencies; the wheel is
# reinstalled every run), and the tests run from outside the tree with
# nothing from python/ on the path (SHARDSTATE_TEST_INSTALLED=1 makes
# tests/test_packaging.py insist on it). pytest's own exit status (5 =
# nothing collected) makes make fail on any failure or on an empty run.
# `make check` runs the same suite in place, on the in-tree build (quicker
# while developing).
WHEEL_DIR   := build/wheel
WHEEL_VENV  := build/wheel-venv
WHEEL_STAMP := $(WHEEL_VENV)/.deps-stamp
# The Makefile exports PYTHONPATH=python for the in-tree targets; here it
# must go, or pip sees python/shardstate.egg-info as installed and skips
# the install, and the tests would import the tree instead of the wheel.
WHEEL_ENV   := env -u PYTHONPATH
PYTEST_ARGS ?=
TESTS       ?= tests

$(WHEEL_STAMP): pyproject.toml
	rm -rf $(WHEEL_VENV)
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_ENV) $(WHEEL_VENV)/bin/pip install -q --upgrade pip
	$(WHEEL_ENV) $(WHEEL_VENV)/bin/pip install -q "torch==2.13.0" "numpy>=1.23" "pytest>=7" \
	    "hypothesis>=6" "setuptools>=77" "zstandard>=0.22" \
	    "fsspec>=2023.1" "s3fs>=2023.1" "moto[server]>=5" "safetensors>=0.4" "tqdm>=4.60"
	touch $@

test: $(WHEEL_STAMP)
	rm -rf $(WHEEL_DIR) build/wheel-run
	$(WHEEL_ENV) $(WHEEL_VENV)/bin/pip wheel -q --no-deps -w $(WHEEL_DIR) .
	$(WHEEL_ENV) $(WHEEL_VENV)/bin/pip install -q --force-reinstall --no-deps \
	    $(WHEEL_DIR)/shardstate-*.whl
	mkdir -p build/wheel-run
	cd build/wheel-run && $(WHEEL_ENV) $(CURDIR)/$(WHEEL_VENV)/bin/python -c \
	    "import shardstate.checkpoint, shardstate.fsdp; print('installed:', shardstate.__file__)"
	cd build/wheel-run && $(WHEEL_ENV) SHARDSTATE_TEST_INSTALLED=1 \
	    $(CURDIR)/$(WHEEL_VENV)/bin/python -m pytest -q -p no:cacheprovider \
	    --rootdir=$(CURDIR) -c $(CURDIR)/pyproject.toml $(PYTEST_ARGS) \
	    $(addprefix $(CURDIR)/,$(TESTS))

# The former name of `make test`.
wheel-test: test

check: build
	$(PY) -m pytest -q $(PYTEST_ARGS) $(TESTS)

# ruff over the Python, clang-format (check mode) over the C; pinned versions.
LINT_STAMP := $(VENV)/.lint-stamp
$(LINT_STAMP): $(STAMP)
	$(VENV)/bin/pip install -q "ruff==0.17.6" "clang-format==23.1.5"
	touch $@
C_FILES = $(wildcard csrc/core/*.[ch] csrc/py/*.[ch] tests/c/*.[ch] tests/fuzz/*.c)
lint: $(LINT_STAMP)
	$(VENV)/bin/ruff check python tests benchmarks scripts setup.py
	$(VENV)/bin/clang-format --dry-run --Werror $(C_FILES)

# C-level tests of csrc/core, built with ASan+UBSan, one program per file.
build/ctest/%: tests/c/%.c $(CORE_SRC) $(wildcard csrc/core/*.h) tests/c/ss_test.h
	@mkdir -p build/ctest
	$(CC) $(CFLAGS_C) -fsanitize=address,undefined -fno-sanitize-recover=undefined \
	    -o $@ $< $(CORE_SRC) -ldl

# Stand-in libcudart / libnccl for test_cuda: tiny shared objects that
# export the symbols the loaders resolve, each variant compiled with its own
# version or omission (see tests/c/fake_*.c). Plain cc, no sanitizers, no
# CUDA headers (the ctest build covers the header-less declarations; setup.py
# covers the header checks when a toolkit is found).
FAKE_DIR  := build/ctest/fakes
FAKE_LIBS := $(addprefix $(FAKE_DIR)/libfake_,cudart_ok.so cudart_old.so cudart_nosym.so \
             cudart_nodev.so nccl_ok.so nccl_old.so nccl_oldenc.so nccl_nosym.so)
FAKE_cudart_old    := -DFAKE_RUNTIME_VERSION=10020
FAKE_cudart_nosym  := -DFAKE_OMIT_EVENT_QUERY
FAKE_cudart_nodev  := -DFAKE_DEVICE_ERROR=100
FAKE_nccl_old      := -DFAKE_NCCL_VERSION=21105
FAKE_nccl_oldenc   := -DFAKE_NCCL_VERSION=2804
FAKE_nccl_nosym    := -DFAKE_OMIT_SEND

$(FAKE_DIR)/libfake_cudart_%.so: tests/c/fake_cudart.c
	@mkdir -p $(FAKE_DIR)
	$(CC) -std=c11 -shared -fPIC -O1 $(FAKE_cudart_$*) -o $@ $<

$(FAKE_DIR)/libfake_nccl_%.so: tests/c/fake_nccl.c
	@mkdir -p $(FAKE_DIR)
	$(CC) -std=c11 -shared -fPIC -O1 $(FAKE_nccl_$*) -o $@ $<

build/ctest/test_cuda build/ctest/test_devcuda build/ctest/test_comm: $(FAKE_LIBS)
build/ctest/test_cuda build/ctest/test_devcuda build/ctest/test_comm: CFLAGS_C += -DSS_TEST_FAKE_DIR='"$(CURDIR)/$(FAKE_DIR)"'

# Runs each C test program of $(1), sums their "N passed" / "N failed" lines.
define run_ctests
	@set -e; p=0; f=0; for t in $(1); do \
	    out=$$($$t) || st=1; echo "$$out"; \
	    p=$$((p + $$(echo "$$out" | sed -n 's/.*: \([0-9]*\) passed.*/\1/p'))); \
	    f=$$((f + $$(echo "$$out" | sed -n 's/.* \([0-9]*\) failed.*/\1/p'))); \
	done; echo "$(2): $$p passed, $$f failed"; test $$f -eq 0 && test -z "$$st"
endef

ctest: $(CTESTS)
	$(call run_ctests,$(CTESTS),ctest)

# The same C tests under ThreadSanitizer: the pool, the batch engine and the
# staging pipeline share memory between threads; a data race fails the run.
TSAN_CTESTS := $(patsubst build/ctest/%,build/tsan/%,$(CTESTS))
build/tsan/%: tests/c/%.c $(CORE_SRC) $(wildcard csrc/core/*.h) tests/c/ss_test.h
	@mkdir -p build/tsan
	$(CC) $(CFLAGS_C) -fsanitize=thread -o $@ $< $(CORE_SRC) -ldl

# A single-module parser's test links only its module (a tenth of the build).
build/ctest/test_stheader build/tsan/test_stheader: CORE_SRC = csrc/core/ss_stheader.c csrc/core/ss_error.c
build/tsan/test_cuda build/tsan/test_devcuda build/tsan/test_comm: $(FAKE_LIBS)
build/tsan/test_cuda build/tsan/test_devcuda build/tsan/test_comm: CFLAGS_C += -DSS_TEST_FAKE_DIR='"$(CURDIR)/$(FAKE_DIR)"'

tsan-ctest: $(TSAN_CTESTS)
	$(call run_ctests,$(TSAN_CTESTS),tsan-ctest)

# ---------------------------------------------------------------------------
# fuzz: coverage-guided fuzzing (libFuzzer) of the C parsers of on-disk bytes.
# Each tests/fuzz/fuzz_<name>.c is built with clang (installed from Debian's
# packages when it, or libFuzzer's runtime, is missing) under ASan+UBSan
# against the core files it names below; it replays every input ever kept
# in tests/fuzz/crashes/ (any parser's), then fuzzes for its share of
# FUZZ_SECONDS, seeded with FUZZ_SEED (printed; by default the clock), over
# its seed corpus tests/fuzz/corpus/fuzz_<name>/. New inputs go to a scratch
# directory (build/fuzz/new/), never into the committed corpus; a crash
# fails the target and is written to tests/fuzz/crashes/ (commit it: it is
# replayed from then on). The Python parsers: tests/test_fuzz_parsers.py.
FUZZ_CC      ?= clang
FUZZ_SECONDS ?= 60
ifndef FUZZ_SEED
FUZZ_SEED    := $(shell date +%s)
endif
FUZZ_FLAGS   := -std=c11 -D_GNU_SOURCE -g -O1 -Icsrc/core \
                -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
FUZZERS      := $(patsubst tests/fuzz/%.c,build/fuzz/%,$(sort $(wildcard tests/fuzz/fuzz_*.c)))
# libFuzzer's per-input limits: a slow input (a hang) or a big allocation fails.
FUZZ_LIMITS  := -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=512

build/fuzz/fuzz_pickle: csrc/core/ss_pickle.c csrc/core/ss_error.c
build/fuzz/fuzz_mdread: csrc/core/ss_mdread.c csrc/core/ss_pickle.c csrc/core/ss_error.c
build/fuzz/fuzz_stheader: csrc/core/ss_stheader.c csrc/core/ss_error.c
build/fuzz/fuzz_zipread: csrc/core/ss_zipread.c csrc/core/ss_zipdtype.c csrc/core/ss_crc.c csrc/core/ss_crc_x86.c \
    csrc/core/ss_error.c

build/fuzz/.clang-ok:
	@mkdir -p build/fuzz
	@printf 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n)\n{ (void)d; (void)n; return 0; }\n' \
	    > build/fuzz/probe.c
	$(FUZZ_CC) -fsanitize=fuzzer,address,undefined -o build/fuzz/probe build/fuzz/probe.c \
	    || (apt-get update && apt-get install -y --no-install-recommends clang libclang-rt-dev \
	        && $(FUZZ_CC) -fsanitize=fuzzer,address,undefined -o build/fuzz/probe build/fuzz/probe.c)
	touch $@

build/fuzz/fuzz_%: tests/fuzz/fuzz_%.c $(wildcard csrc/core/*.h) build/fuzz/.clang-ok
	$(FUZZ_CC) $(FUZZ_FLAGS) -o $@ $(filter %.c,$^)

.PHONY: fuzz
fuzz: $(FUZZERS)
	@set -e; n=$(words $(FUZZERS)); secs=$$(( $(FUZZ_SECONDS) / n )); [ $$secs -ge 1 ] || secs=1; \
	for f in $(FUZZERS); do \
	    name=$$(basename $$f); new=build/fuzz/new/$$name; rm -rf $$new; mkdir -p $$new; \
	    kept=$$(ls tests/fuzz/crashes/* | grep -v README); \
	    echo "== $$name: replaying $$(echo $$kept | wc -w) kept crash input(s)"; \
	    if [ -n "$$kept" ] && ! $$f $(FUZZ_LIMITS) $$kept; then \
	        echo "$$name FAILED on a kept input (the last one named above): a regression"; exit 1; \
	    fi; \
	    dict=; [ ! -f tests/fuzz/$$name.dict ] || dict=-dict=tests/fuzz/$$name.dict; \
	    echo "== $$name: -seed=$(FUZZ_SEED) for $$secs s over tests/fuzz/corpus/$$name" \
	         "(libFuzzer's log: build/fuzz/$$name.log)"; \
	    if ! $$f $(FUZZ_LIMITS) -seed=$(FUZZ_SEED) -max_total_time=$$secs -print_final_stats=1 \
	        $$dict -artifact_prefix=tests/fuzz/crashes/$$name- $$new tests/fuzz/corpus/$$name \
	        > build/fuzz/$$name.log 2>&1; then \
	        tail -n 60 build/fuzz/$$name.log; \
	        echo "$$name FAILED with -seed=$(FUZZ_SEED): the input is in tests/fuzz/crashes/" \
	             "(the 'Test unit written to' line above); replay it with: make $$f &&" \
	             "$$f tests/fuzz/crashes/<file>; rerun this fuzzing with: make fuzz" \
	             "FUZZ_SEED=$(FUZZ_SEED) FUZZ_SECONDS=$(FUZZ_SECONDS)"; \
	        exit 1; \
	    fi; \
	    grep -E '^INFO: Seed|^#[0-9]+.*DONE|^stat::' build/fuzz/$$name.log; \
	done; echo "$$n fuzzer(s), $$secs s each, seed $(FUZZ_SEED): no crash, no kept input failed"; \
	echo "fuzz: $$n passed, 0 failed"

# The pytest suite against an ASan+UBSan build of the extension. The
# normal build is restored afterwards.
# The suite on an ASan+UBSan build of the extension. The FSDP model tests
# (torch's FSDP machinery, minutes of training steps) are left to `make test`:
# the C they reach (flat copies, batch I/O) runs here through
# test_fsdp_layout, test_io, test_filesystem and the checkpoint tests.
ASAN_SKIP = --ignore=tests/test_state_dict.py --ignore=tests/test_fsdp_optim.py \
	--ignore=tests/test_fsdp_resume.py
asan-test: $(STAMP)
	SHARDSTATE_SANITIZE=1 $(PY) setup.py -q build_ext --inplace --force
	LD_PRELOAD="$(LIBASAN)" PYTHONMALLOC=malloc \
	    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	    $(PY) -m pytest -q -p no:cacheprovider $(ASAN_SKIP) tests; st=$$?; \
	    $(PY) setup.py -q build_ext --inplace --force; exit $$st

# A run under CheckpointManager preempted by SIGTERM at 2 ranks, resumed at 3, and the
# shardstate command on the result; then FSDP and DTensor states saved with 2 ranks,
# resumed with 3 (another placement), every element verified.
DEMO_DIR ?= build/demo-checkpoint
DEMO_GIB ?= 1.5
demo: build
	OMP_NUM_THREADS=1 $(PY) scripts/demo_run.py --dir build/demo-run
	rm -rf build/demo-run $(DEMO_DIR)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=2 scripts/demo.py save --dir $(DEMO_DIR) --gib $(DEMO_GIB)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=3 scripts/demo.py resume --dir $(DEMO_DIR) --gib $(DEMO_GIB)
	rm -rf $(DEMO_DIR)

bench: build
	$(PY) benchmarks/bench_io.py

# DCP planning at 1,024 and 4,096 simulated ranks against torch's planners.
bench-planning: build
	$(PY) benchmarks/bench_planning.py

# FsspecWriter/Reader against torch's, on a local moto S3 server and memory://.
bench-fsspec: build
	$(PY) benchmarks/bench_fsspec.py

clean:
	rm -rf build python/shardstate/*.so
