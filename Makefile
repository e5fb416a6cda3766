VENV ?= .venv
PY := $(VENV)/bin/python

# What `make lint` (and so `make test`) checks with ruff; rules in pyproject.toml.
LINT_PATHS := sklearn_lla tests benchmarks examples

.PHONY: install demo lint test test-slow test-all examples docs bench reproduce clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)
	touch $@

## Set everything up and run the quick-start demo (saves examples/output/quickstart_*.png)
demo: install
	MPLBACKEND=Agg $(PY) examples/quickstart.py

## Lint with ruff (the rules are in pyproject.toml)
lint: install
	$(PY) -m ruff check $(LINT_PATHS)

## Set everything up, lint, then run the test suite, doctests and docstring checks included
test: install lint
	$(PY) -m pytest -n 2 -m "not slow" --doctest-modules sklearn_lla tests

## Only the tests marked slow; succeeds when there are none (pytest exits 5: no tests)
test-slow: install
	$(PY) -m pytest -m slow tests || [ $$? -eq 5 ]

test-all: install lint
	$(PY) -m pytest -n 2 --doctest-modules sklearn_lla tests

## Run every example script (each under a minute on 2 cores; plots in examples/output/)
EXAMPLES := $(sort $(wildcard examples/*.py))
examples: install
	@set -e; for f in $(EXAMPLES); do \
		echo "== $$f"; start=$$(date +%s); \
		MPLBACKEND=Agg $(PY) $$f; \
		echo "== $$f: $$(( $$(date +%s) - start )) s"; \
	done

## Build the documentation site into docs/_build/html (Sphinx; warnings are errors); runs
## every example for the gallery (a few minutes). MathJax is loaded by the browser.
docs: install
	MPLBACKEND=Agg $(PY) -m sphinx -b html -W --keep-going -q docs docs/_build/html
	@echo "docs built: open docs/_build/html/index.html"

bench: install
	$(PY) benchmarks/bench_ella.py

## The papers' protocol (3 x 200 tanh MLP, then every registered method) on a Year-shaped
## synthetic file; other data: benchmarks/reproduce.py --help, docs/datasets.md
reproduce: install
	$(PY) benchmarks/reproduce.py --data year-synthetic

clean:
	rm -rf $(VENV) build dist *.egg-info examples/output docs/_build docs/generated docs/auto_examples
