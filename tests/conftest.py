"""Shared fixtures. The real model is loaded once per test session and shared.

Tests that need the real model do not skip when it is missing: `make test` installs it,
and a silently skipped reference test would look like a pass.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

# The browser fixtures are session-scoped and must exist once per session: one JupyterLab
# server, one Playwright instance (a second sync_playwright() in the same process fails).
from browser_utils import _chromium, jupyter_lab, lab  # noqa: E402,F401

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # inherited by notebook kernels
# Each C++ kernel's default build for every shape it takes, nothing timed: results do not
# depend on a measurement (minillm.cpu_select; tests/test_cpu_select.py fakes its timer).
os.environ.setdefault("MINILLM_CPU_KERNEL", "default")
from minillm.devices import cuda_requested  # noqa: E402  (torch only: imports no triton)

if not cuda_requested():  # before transformers imports triton (see minillm.kernels); also
    os.environ.setdefault("TRITON_INTERPRET", "1")  # with MINILLM_DEVICE=cpu on a GPU machine
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def smollm():
    """(model, tokenizer): SmolLM2-135M-Instruct in fp32 with the torch backend."""
    import minillm
    model, tokenizer = minillm.load_model(dtype=torch.float32)
    return model, tokenizer


@pytest.fixture(scope="session")
def hf_reference():
    """(model, tokenizer) from Hugging Face transformers loading the same GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from minillm.gguf_loader import find_model_path

    hf_logging.disable_progress_bar()
    path = find_model_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


@pytest.fixture
def tiny_model():
    """A 2-layer random-weight model with GQA (4 query heads, 2 KV heads)."""
    from minillm import LlamaModel, ModelConfig
    return LlamaModel(ModelConfig.tiny()).init_random_weights(seed=0).eval()
