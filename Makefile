# Every install step lives here: CI runs `make test` on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test bench-cpu bench-torch bench-jax bench-tf bench-models bench-dynamic clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,torch,jax,tf,cuda]'
	touch $(STAMP)

demo: install
	@for f in examples/*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

test: install
	$(PY) -m pytest -q tests

bench-cpu: install
	$(PY) bench/cpu.py

bench-torch: install
	$(PY) bench/torch_bench.py

bench-jax: install
	$(PY) bench/jax_bench.py

bench-tf: install
	$(PY) bench/tf_bench.py

bench-models: install
	$(PY) bench/models.py

bench-dynamic: install
	$(PY) bench/dynamic.py

clean:
	rm -rf $(VENV) polyjit_dump .pytest_cache
