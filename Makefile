# Two commands for a new user: `make demo` (main job on CPU) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all gpu-test clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,data]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

# Every test, slow ones included.
test-all: $(STAMP)
	JAX_FLASH_SLOW=1 $(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m experiments.demo

clean:
	rm -rf $(VENV) .pytest_cache
