PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: train test test-fast bench gpu-check gpu-wheels lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/python train.py $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

bench: $(STAMP)
	$(BIN)/python scripts/bench/run.py $(ARGS)

# the GPU path checked in one run (docs/gpu.md); without CUDA its CPU analogue
gpu-check: $(STAMP)
	$(BIN)/python scripts/gpu_check.py $(ARGS)

# the wheels a GPU machine with torch but without Hydra needs to run flx from src/ (docs/gpu.md): pure-Python, for
# its Python 3.12; antlr4-python3-runtime 4.9.3 (omegaconf's parser runtime) is published as a source archive only
GPU_WHEELS := hydra-core==1.3.8 omegaconf==2.3.1
PIP_312 := --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	--platform manylinux1_x86_64
gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download --quiet $(PIP_312) -d .whl $(GPU_WHEELS)
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w .whl antlr4-python3-runtime==4.9.3
	ls -s .whl

# ruff, then mypy over the parts' door and what runs behind it ([tool.mypy] in pyproject.toml)
lint: $(STAMP)
	$(BIN)/ruff check src tests scripts train.py
	$(BIN)/python -m mypy

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
