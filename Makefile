# Two entry points: `make demo` (the CP training demo) and `make test`.
# Both create .venv on first use. torch is pinned first so that pip does not
# pull a multi-GB CUDA build on a CPU-only machine.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.cpdata-installed

.PHONY: demo test bench lint clean

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/train_cp.py

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/cpdata bench

lint: $(STAMP)
	$(VENV)/bin/ruff check cpdata pipelines examples tests

clean:
	rm -rf $(VENV) build *.egg-info
