PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: train test test-fast bench lint clean

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

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts train.py

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
