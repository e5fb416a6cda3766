VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test test-slow test-all examples bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)
	touch $@

## Set everything up and run the quick-start demo (saves examples/output/quickstart_*.png)
demo: install
	MPLBACKEND=Agg $(PY) examples/quickstart.py

## Set everything up and run the test suite
test: install
	$(PY) -m pytest -n 2 -m "not slow" --doctest-modules sklearn_lla tests

test-slow: install
	$(PY) -m pytest -m slow tests

test-all: install
	$(PY) -m pytest -n 2 tests

examples: install
	MPLBACKEND=Agg $(PY) examples/quickstart.py
	MPLBACKEND=Agg $(PY) examples/classification.py

bench: install
	$(PY) benchmarks/bench_ella.py

clean:
	rm -rf $(VENV) build dist *.egg-info examples/output
