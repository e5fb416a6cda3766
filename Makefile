VENV ?= .venv
PY := $(VENV)/bin/python

# What `make lint` (and so `make test`) checks with ruff; rules in pyproject.toml.
LINT_PATHS := sklearn_lla tests benchmarks examples

.PHONY: install demo lint test test-slow test-all examples bench clean

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

examples: install
	MPLBACKEND=Agg $(PY) examples/quickstart.py
	MPLBACKEND=Agg $(PY) examples/classification.py

bench: install
	$(PY) benchmarks/bench_ella.py

clean:
	rm -rf $(VENV) build dist *.egg-info examples/output
