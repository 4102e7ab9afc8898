"""Interactive figures for the workbook's notebooks (ipywidgets + matplotlib).

Each widget module has three layers, so the numbers can be tested without a display:

- a pure data function (``roofline.roofline_data``, ``memory_wall.memory_wall_data``,
  ``kv_growth.kv_growth_data``, ``attention_variants.attention_variants_data``,
  ``speculation.speculation_data``, ``quantization.explorer_data``, ``parallelism.parallelism_data``,
  ``serving_sim.serving_sim_data``, ``cost.cost_data``) returning a dataclass of
  arrays, labels and summary lines, computed with ``minillm.calc`` so the book and the widgets cannot disagree;
- a figure function (``draw_*``) turning that data into a matplotlib Figure;
- a view (``view(...)``) with sliders and dropdowns that recomputes and redraws into an
  ``ipywidgets.Output`` on every change. ``view.controls[name].value = ...`` drives it;
  ``view.data`` / ``view.figure`` hold the latest result.

Every lab starts with ``DEVICE, DTYPE = widgets.lab_header("NN-topic")``: the one device
(``minillm.devices.default_device()``) and dtype the lab runs on, and its measured run time.

Lab 01 (measure once, plot many)::

    from minillm import load_model, measure, perf
    import widgets
    model, _ = load_model()
    profile = perf.measure_machine()
    ops = measure.measure_operations(model)          # ~15 s, with a progress bar
    widgets.roofline.view(profile, ops)
    widgets.memory_wall.view(profile, measured=ops)
    widgets.kv_growth.view(model="Llama-2-70B", seq_len=4096)
"""
from . import (attention_variants, batching, block_pool_grid, cost, kv_growth, memory_wall,
               parallelism, quantization, roofline, serving_sim, speculation)
from ._hardware import THIS_MACHINE
from ._models import MODEL_PRESETS, ModelSpec
from ._view import figure_image
from .lab_header import lab_header

__all__ = ["roofline", "memory_wall", "kv_growth", "attention_variants", "batching",
           "block_pool_grid", "speculation", "quantization", "parallelism", "serving_sim", "cost", "MODEL_PRESETS", "THIS_MACHINE",
           "ModelSpec", "figure_image", "lab_header"]
