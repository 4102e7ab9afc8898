"""Weight quantization: RTN, GPTQ and AWQ, packed int4/int8 storage, fast quantized linears,
measured quality, and safetensors files.

    qw = quant.rtn(w, bits=4, group_size=64, sym=False)     # QuantizedWeight: q, scale, zero
    qw = quant.gptq(w, H, bits=4, group_size=64)            # H = quant.hessian(inputs)
    qmodel = quant.quantize_model(model, "gptq", bits=4, group_size=64)
    quant.evaluate(qmodel, tokenizer, ref_model=model)      # {'ppl', 'kl', 'top1', ...}
    quant.save(qmodel, "w4.safetensors"); qmodel = quant.load("w4.safetensors")

Modules, in reading order:
    weights.py      QuantizedWeight and RTN: scales, zero points, groups
    gptq.py         GPTQ: rounding with error feedback through the inverse Hessian
    awq.py          AWQ: activation-aware scales folded into the norms, and clipping
    packing.py      the packed layout (two int4 per byte) every kernel and file reads
    qlinear.py      QuantLinear: the Linear that runs on packed weights
    cpu_kernels.py  C++ W4/W8 kernels for a few rows on the CPU (the decode path)
    quantize.py     quantize_model: a whole model, layer by layer on calibration data
    data.py         calibration windows and evaluation text (the Lee corpus, split)
    evaluate.py     perplexity, KL to the reference and top-1 agreement
    io.py           save / load as safetensors
    kv.py           an int8 KV cache: one fp16 scale per cached vector
    formats.py      FP8 E4M3/E5M2 and NF4, fake-quantized (quality only; no kernel reads them)
    gguf_types.py   GGUF tensor types: block layouts, the shipped file's types, Q4_K_M's mix
"""
from .awq import clip_search, search_scale
from .data import calibration_windows, evaluation_text
from .evaluate import evaluate, evaluate_many, evaluation_windows
from .gptq import gptq, hessian
from .packing import dequantize_packed, pack, packed_bytes, unpack
from .qlinear import QuantLinear
from .quantize import GPU_LAYOUT, METHODS, quantize_model, weight_bytes
from .weights import QuantizedWeight, rtn
from .io import load, save
from .kv import dequantize_kv_int8, int8_kv_append, int8_kv_roundtrip, quantize_kv_int8

__all__ = ["QuantizedWeight", "rtn", "gptq", "hessian", "quantize_model", "QuantLinear",
           "calibration_windows", "evaluation_text", "evaluate", "evaluate_many", "evaluation_windows",
           "pack", "unpack", "dequantize_packed", "packed_bytes", "search_scale",
           "clip_search", "weight_bytes", "save", "load", "METHODS", "GPU_LAYOUT",
           "quantize_kv_int8", "dequantize_kv_int8", "int8_kv_roundtrip", "int8_kv_append"]
