# Entry points: `make demo` (the CP training demo), `make test` and `make gpu-check` (a CUDA machine).
# Both create .venv on first use. torch is pinned first so that pip does not
# pull a multi-GB CUDA build on a CPU-only machine. `make demo` installs only
# the runtime (torch, torchdata, numpy and cpdata itself), `make gpu-check` adds transformers; `make test`, `bench`
# and `lint` add the dev extra (pytest, ruff, transformers, datasets, trl, ...) and the peers below.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TORCH_STAMP := $(VENV)/.cpdata-torch
RUNTIME_STAMP := $(VENV)/.cpdata-runtime
DEV_STAMP := $(VENV)/.cpdata-dev
HF_STAMP := $(VENV)/.cpdata-hf
GPU_CHECK_OUT ?= gpu-check
# Peers the tests compare against side by side; their CP and indexed-dataset modules import with torch alone,
# and their own dependency lists would pull GPU stacks, hence --no-deps.
PEERS := "nemo-automodel==0.7.0" "megatron-core==0.16.1"
# torchtitan 0.3.0 does not co-install with the dev extra (pip would take datasets 5.2 -> 4.7 and huggingface_hub
# 2.4 -> 1.33 under transformers), so the torchtitan tests run it from its own environment: torch at the same pin,
# torchtitan and cpdata (editable). tests/test_torchtitan.py finds it here; under CI a missing one fails the test.
TITAN_VENV ?= .venv-titan
TITAN_PY := $(TITAN_VENV)/bin/python
TITAN_SPEC ?= torchtitan==0.3.0
TITAN_STAMP := $(TITAN_VENV)/.cpdata-titan

.PHONY: demo test bench lint gpu-check clean titan-venv

$(PY):
	python3 -m venv $(VENV)

$(TORCH_STAMP): $(PY)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	touch $(TORCH_STAMP)

$(RUNTIME_STAMP): $(TORCH_STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e .
	touch $(RUNTIME_STAMP)

$(DEV_STAMP): $(TORCH_STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps $(PEERS)
	touch $(RUNTIME_STAMP) $(DEV_STAMP)

$(TITAN_PY):
	python3 -m venv $(TITAN_VENV)

$(TITAN_STAMP): $(TITAN_PY) pyproject.toml
	$(TITAN_PY) -m pip install --upgrade --quiet pip
	$(TITAN_PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(TITAN_PY) -m pip install --quiet "$(TITAN_SPEC)"
	$(TITAN_PY) -m pip install --quiet -e .
	touch $(TITAN_STAMP)

titan-venv: $(TITAN_STAMP)

# The runtime plus transformers (the HF parts): no test or lint tools.
$(HF_STAMP): $(TORCH_STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e ".[hf]"
	touch $(RUNTIME_STAMP) $(HF_STAMP)

demo: $(RUNTIME_STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/train_cp.py

test: $(DEV_STAMP) $(TITAN_STAMP)
	$(PY) -m pytest -q

bench: $(DEV_STAMP)
	$(VENV)/bin/cpdata bench

# On a machine with CUDA GPUs: <= 8 minutes on one H100 / H200; prints the folder it writes.
gpu-check: $(HF_STAMP)
	$(PY) -m cpdata.bench.gpu_check --out $(GPU_CHECK_OUT)

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check cpdata pipelines examples tests

clean:
	rm -rf $(VENV) $(TITAN_VENV) build *.egg-info
