"""Runs of the real model for Lab 06: quantized copies measured for quality, bytes and speed,
with every result cached in memory and on disk; the activation maxima that show outliers;
and the benchmark's own table when it has been run. The figures are in
``widgets.quantization``.

    runs = QuantRuns(model, tok, eval_windows=2, calibration_windows={"gptq": 4, "awq": 1})
    r = runs.measure("gptq", 4, 64)           # QuantResult: ppl, kl, top1, bytes, tok/s
    runs.measure_many([("rtn", 8, None), ("rtn", 4, 64), ("rtn", 3, 64)])  # fp32 runs once
    runs.fp32()                               # the reference row
    runs.measure_many([("e4m3", 8, None), ("nf4", 4, 64)])  # number formats, fake-quantized
    maxima = activation_maxima(model, ids)    # {projection: [layers, channels]} of max |x|
    x = projection_input(model, ids, 3, "o_proj")  # [tokens, 576]: one projection's inputs
    benchmark_rows()                          # benchmarks/results/quant.json, or None
    decode_against_bandwidth(model, tok)      # float vs w4 decode on the device, of ceiling

Caching: a result is keyed by the model (its name, dtype and a checksum of a few weights),
the setting (method, bits, group size, LM head) and the measurement's size (evaluation and
calibration windows). The disk cache is one JSON file under ``minillm.data.cache_dir()``;
a cached result says so (``source == "cached"``). Speeds are cached too: they belong to the
machine that measured them, and the cache lives on that machine.

The methods are quantize_model's ("rtn", "gptq", "awq": packed integers, timed) and the
number formats of ``minillm.quant.formats`` ("e4m3", "e5m2": FP8 with one scale per row;
"nf4": 16 normal-quantile levels per block), which are fake-quantized: scored for quality,
their bytes counted as the format would store them, and not timed (no kernel reads them).

Invariants: ``measure`` never changes ``model`` (``quantize_model`` returns a copy); a
setting ``quantize_model`` rejects raises its ValueError unchanged and caches nothing.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch

from minillm import generate, quant, timing
from minillm.quant import formats
from minillm.quant.quantize import PROJECTIONS, projections

__all__ = ["QuantResult", "QuantRuns", "decode_tok_s", "activation_maxima", "projection_input",
           "benchmark_rows", "default_cache_path", "label", "decode_against_bandwidth"]

CACHE_VERSION = 2  # 2: the W4/W8 kernels and decode_tok_s changed; re-measure
BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "quant.json"
DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


def label(method: str, bits: int, group_size, lm_head=False) -> str:
    """'rtn w4 g64', 'gptq w8 per-channel', 'rtn w4 g64, head w4'."""
    g = "per-channel" if group_size is None else f"g{group_size}"
    head = "" if lm_head is False else f", head w{bits if lm_head is True else lm_head}"
    return f"{method} w{bits} {g}{head}"


@dataclasses.dataclass
class QuantResult:
    method: str                 # "fp32", "rtn", "gptq", "awq", or a format: "e4m3", "e5m2", "nf4"
    bits: int
    group_size: int | None
    lm_head: bool | int
    ppl: float
    kl: float
    top1: float
    tokens: int                 # evaluated (predicted) tokens
    bytes_per_token: int        # weight bytes a batch-1 decode step reads (quant.weight_bytes)
    stored_bytes: int
    tok_s: float | None = None  # batch-1 decode, eager (None for a fake-quantized format)
    quantize_s: float | None = None
    eval_windows: int | None = None
    calibration_windows: int | None = None
    source: str = "measured"    # "measured", "cached", or where it was read from

    @property
    def label(self) -> str:
        return "fp32" if self.method == "fp32" else label(self.method, self.bits, self.group_size,
                                                          self.lm_head)


def default_cache_path() -> Path:
    from minillm.data import cache_dir

    return cache_dir() / "lab06" / "quant_runs.json"


def decode_tok_s(model, ids, new_tokens: int = 32, repeats: int = 3) -> float:
    """Batch-1 decode tok/s with the prefill cancelled (`minillm.timing.decode_tok_s`, from
    the best of `repeats` timings of 1 and of `new_tokens` tokens)."""
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 2:
        raise ValueError(f"new_tokens must be at least 2 to cancel the prefill, got {new_tokens!r}")
    t_one, t_all = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        generate(model, ids, 1, ignore_eos=True)
        t1 = time.perf_counter()
        generate(model, ids, new_tokens, ignore_eos=True)
        t2 = time.perf_counter()
        t_one.append(t1 - t0)
        t_all.append(t2 - t1)
    return timing.decode_tok_s(t_one, t_all, new_tokens)


def _fingerprint(model) -> str:
    """The cache key of a model: its weights and dtype, and its device unless it is the CPU
    (a speed measured on one device must not be served on another; CPU keys predate that)."""
    w = model.embed_tokens.weight
    layer = model.layers[0].attn.qkv_proj.weight
    check = float(w[:8].detach().double().sum() + layer[:8].detach().double().sum())
    where = "" if w.is_cpu else f"-{w.device.type}"
    return f"{model.config.name}-{str(w.dtype).split('.')[-1]}-{check:.6e}{where}"


class QuantRuns:
    """Quantized copies of one model, measured once per setting (then from the cache).

    eval_windows: held-out windows of 512 tokens for ppl / KL / top-1 (2 ≈ 1,000 tokens).
    calibration_windows: windows of 512 for GPTQ and AWQ (the benchmark uses 128): one number
    for both, or {"gptq": n, "awq": m} (AWQ's search costs more per window).
    cache_path: a JSON file, "default" (``default_cache_path()``) or None (memory only)."""

    def __init__(self, model, tokenizer, eval_windows: int = 2, calibration_windows: int = 4,
                 decode_tokens: int = 32, prompt_ids=None, cache_path="default",
                 window: int = 512, measure_speed: bool = True):
        self.model, self.tokenizer = model, tokenizer
        self.eval_windows, self.calibration_windows = eval_windows, calibration_windows
        self.decode_tokens, self.window, self.measure_speed = decode_tokens, window, measure_speed
        if prompt_ids is None:
            prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": DEFAULT_PROMPT}])
        self.prompt_ids = list(prompt_ids)
        self.cache_path = default_cache_path() if cache_path == "default" else cache_path
        self.results: dict[str, QuantResult] = {}
        self.models: dict[str, object] = {}   # the last few quantized copies, for reuse
        self.keep_models = 4
        self.runs = 0                          # settings actually measured (not from a cache)
        self._calibration = {}
        self._fingerprint = _fingerprint(model)

    # keys and the disk cache -------------------------------------------------------------
    def windows_for(self, method) -> int | None:
        """Calibration windows `method` uses (None for RTN and fp32: they need none)."""
        if method not in ("gptq", "awq"):
            return None
        n = self.calibration_windows
        return n[method] if isinstance(n, dict) else n

    def key(self, method, bits, group_size, lm_head=False) -> str:
        return json.dumps([CACHE_VERSION, self._fingerprint, method, bits, group_size, lm_head,
                           self.eval_windows, self.windows_for(method), self.window])

    def _disk(self) -> dict:
        if self.cache_path is None or not Path(self.cache_path).exists():
            return {}
        try:
            return json.loads(Path(self.cache_path).read_text())
        except (OSError, ValueError):
            return {}

    def _save(self, key: str, result: QuantResult) -> None:
        if self.cache_path is None:
            return
        path = Path(self.cache_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self._disk()
        data[key] = dataclasses.asdict(result)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)

    def cached(self, method, bits, group_size, lm_head=False) -> QuantResult | None:
        """The result for a setting if it is in memory or on disk, else None (measures nothing)."""
        key = self.key(method, bits, group_size, lm_head)
        if key in self.results:
            return self.results[key]
        row = self._disk().get(key)
        if row is None:
            return None
        result = QuantResult(**{**row, "source": "cached"})
        self.results[key] = result
        return result

    # measuring ---------------------------------------------------------------------------
    def calibration(self, method: str) -> torch.Tensor:
        n = self.windows_for(method)
        if n not in self._calibration:
            self._calibration[n] = quant.calibration_windows(self.tokenizer, n, self.window)
        return self._calibration[n]

    def quantized(self, method, bits, group_size, lm_head=False):
        """The quantized copy (kept for the last few settings), and the seconds it took."""
        key = self.key(method, bits, group_size, lm_head)
        if key in self.models:
            return self.models[key], None
        calibration = self.calibration(method) if method in ("gptq", "awq") else None
        t0 = time.perf_counter()
        if method in formats.FORMATS:
            if (bits, lm_head) != (formats.FORMATS[method][0], False):
                raise ValueError(f"{method} stores {formats.FORMATS[method][0]}-bit values and keeps "
                                 f"the LM head float: pass bits={formats.FORMATS[method][0]}, "
                                 f"lm_head=False")
            qmodel = formats.fake_quantize_model(self.model, method, group_size)
        else:
            qmodel = quant.quantize_model(self.model, method, bits, group_size,
                                          calibration=calibration, progress=False, lm_head=lm_head)
        seconds = time.perf_counter() - t0
        self.models[key] = qmodel
        while len(self.models) > self.keep_models:
            self.models.pop(next(iter(self.models)))
        return qmodel, seconds

    def fp32(self) -> QuantResult:
        """The float model's own row: its perplexity, KL 0 and top-1 1 by definition."""
        key = self.key("fp32", 32, None)
        hit = self.cached("fp32", 32, None)
        if hit is not None:
            return hit
        res = quant.evaluate(self.model, self.tokenizer, max_windows=self.eval_windows,
                             window=self.window)
        nbytes = quant.weight_bytes(self.model)
        result = QuantResult("fp32", 32, None, False, res["ppl"], 0.0, 1.0, res["tokens"],
                             nbytes["per_token"], nbytes["stored"],
                             self._speed(self.model), None, self.eval_windows, None)
        self.results[key] = result
        self._save(key, result)
        self.runs += 1
        return result

    def _speed(self, model) -> float | None:
        return decode_tok_s(model, self.prompt_ids, self.decode_tokens) if self.measure_speed else None

    def measure(self, method: str, bits: int, group_size=64, lm_head=False) -> QuantResult:
        """One setting's QuantResult (from the cache when it was measured before)."""
        return self.measure_many([(method, bits, group_size, lm_head)])[0]

    def measure_many(self, settings) -> list[QuantResult]:
        """QuantResults for (method, bits, group_size[, lm_head]) settings; the missing ones are
        quantized and evaluated together, so the fp32 reference runs once per window."""
        settings = [tuple(s) + (False,) * (4 - len(s)) for s in settings]
        missing = [s for s in dict.fromkeys(settings) if self.cached(*s) is None]
        if missing:
            models, seconds = {}, {}
            for s in missing:
                models[s], seconds[s] = self.quantized(*s)
            evals = quant.evaluate_many({label(*s): m for s, m in models.items()}, self.tokenizer,
                                        ref_model=self.model, max_windows=self.eval_windows,
                                        window=self.window)
            for s, qmodel in models.items():
                fake = s[0] in formats.FORMATS
                res = evals[label(*s)]
                nbytes = (formats.weight_bytes(self.model, s[0], s[2]) if fake
                          else quant.weight_bytes(qmodel))
                result = QuantResult(s[0], s[1], s[2], s[3], res["ppl"], res["kl"], res["top1"],
                                     res["tokens"], nbytes["per_token"], nbytes["stored"],
                                     None if fake else self._speed(qmodel), seconds[s],
                                     self.eval_windows, self.windows_for(s[0]))
                key = self.key(*s)
                self.results[key] = result
                self._save(key, result)
                self.runs += 1
        return [self.cached(*s) for s in settings]


# --------------------------------------------------------------------------- device speed


def _copy_to(model, device: torch.device, dtype: torch.dtype):
    """`model` itself when it is already there in `dtype`, else a moved copy."""
    if model.device == device and model.embed_tokens.weight.dtype == dtype:
        return model
    return model.deep_copy().to(device=device, dtype=dtype)  # no compiled step, no graphs


def decode_against_bandwidth(model, tokenizer=None, device=None, bandwidth=None, layout=None,
                             new_tokens: int = 32, repeats: int = 3, prompt_ids=None,
                             show: bool = True) -> list[dict]:
    """Batch-1 decode of the float model and of its RTN w4 copy on `device` (default: the
    course's device, CUDA if there is one), each against its bandwidth ceiling.

    The float model runs in the device's dtype (bf16 on CUDA, fp32 on a CPU); the w4 copy
    is ``quantize_model(model, "rtn", 4, **layout)`` moved there (layout: ``quant.GPU_LAYOUT``
    on CUDA, g64 asymmetric on a CPU), so its products go through the W4A16 Triton kernel on
    a GPU (and ``generate`` captures each decode step in a CUDA graph) or the C++ W4 kernel
    on a CPU. Ceiling = bandwidth / the bytes a step reads as stored
    (``quant.weight_bytes``); bandwidth in bytes/s (default: measured, read-only stream).
    Returns one dict per model and prints them (``show``)."""
    from minillm import devices, perf

    device = devices._resolve(device)
    dtype = devices.default_dtype(device)
    if bandwidth is None:
        bandwidth = perf.measure_bandwidth(device)["sum"]
    if layout is None:
        layout = quant.GPU_LAYOUT if devices.is_cuda(device) else {"group_size": 64, "sym": False}
    if prompt_ids is None:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": DEFAULT_PROMPT}])
    source = _copy_to(model, devices.reference_device(), torch.float32)
    w4 = quant.quantize_model(source, "rtn", 4, progress=False, **layout)  # from the float weights
    name = f"w4 g{layout['group_size']} {'sym' if layout['sym'] else 'asym'}"
    rows = []
    for label_, m in ((str(dtype).removeprefix("torch."), _copy_to(model, device, dtype)),
                      (name, w4.to(device=device, dtype=dtype))):
        nbytes = quant.weight_bytes(m)["per_token"]
        tok_s = decode_tok_s(m, list(prompt_ids), new_tokens, repeats)
        rows.append({"model": label_, "device": device.type, "tok_s": tok_s,
                     "MB_per_token": nbytes / 1e6, "ceiling_tok_s": bandwidth / nbytes,
                     "of_ceiling": tok_s * nbytes / bandwidth})
    if show:
        how = ("CUDA graphs; w4 products by the W4A16 Triton kernel" if devices.is_cuda(device)
               else "eager; w4 products by the C++ W4 kernel")
        print(f"{devices.device_name(device)} ({device.type}): bandwidth {bandwidth / 1e9:.1f} "
              f"GB/s; batch-1 decode, {how}")
        print(f"{'model':15} {'tok/s':>8} {'MB/token':>10} {'ceiling tok/s':>15} "
              f"{'of ceiling':>12} {'speed-up':>10}")
        for r in rows:
            print(f"{r['model']:15} {r['tok_s']:8.1f} {r['MB_per_token']:10.1f} "
                  f"{r['ceiling_tok_s']:15.0f} {100 * r['of_ceiling']:11.0f}% "
                  f"{r['tok_s'] / rows[0]['tok_s']:9.2f}×")
    return rows


# --------------------------------------------------------------------------- outliers


@torch.no_grad()
def activation_maxima(model, ids) -> dict:
    """{projection: tensor [layers, in_features]}: the largest |x| each input channel of each
    layer's q|k|v, o, gate|up and down projections sees over the tokens `ids` ([T] or [B, T])."""
    out = {n: [] for n in PROJECTIONS}
    hooks = []
    for layer in model.layers:
        for name, (parent, attr) in projections(layer).items():
            def hook(_m, args, name=name):
                x = args[0].reshape(-1, args[0].shape[-1]).abs().amax(0)
                out[name].append(x.float().cpu())
            hooks.append(getattr(parent, attr).register_forward_pre_hook(hook))
    try:
        ids = torch.as_tensor(ids, device=model.device)
        model(ids[None] if ids.dim() == 1 else ids)
    finally:
        for h in hooks:
            h.remove()
    return {n: torch.stack(v) for n, v in out.items()}


@torch.no_grad()
def projection_input(model, ids, layer: int, name: str) -> torch.Tensor:
    """x [tokens, in_features]: what projection `name` of layer `layer` receives on `ids`
    (the model runs up to that layer only)."""
    parent, attr = projections(model.layers[layer])[name]
    seen = []

    class _Stop(Exception):
        pass

    def hook(_m, args):
        seen.append(args[0].reshape(-1, args[0].shape[-1]).float().clone())
        raise _Stop

    handle = getattr(parent, attr).register_forward_pre_hook(hook)
    try:
        ids = torch.as_tensor(ids, device=model.device)
        model(ids[None] if ids.dim() == 1 else ids)
    except _Stop:
        pass
    finally:
        handle.remove()
    return seen[0]


# --------------------------------------------------------------------------- the benchmark


def benchmark_rows(path: Path | str | None = None) -> tuple[list[QuantResult], dict] | None:
    """(rows, info) from `benchmarks/quant.py`'s results file, or None when it has not been
    run here. info: the machine, the evaluated tokens and the calibration it used."""
    path = Path(path) if path is not None else BENCHMARK
    try:
        quality = json.loads(path.read_text())["quality"]
    except (OSError, ValueError, KeyError):
        return None
    rows = []
    for r in quality.get("rows", []):
        rows.append(QuantResult(r["method"], r["bits"], r.get("group_size"),
                                r.get("lm_head_bits", False), r["ppl"], r["kl"], r["top1"],
                                r["tokens"], r["bytes_per_token"], 0, None, r.get("quantize_s"),
                                None, None, f"benchmarks/results/quant.json"))
    info = {k: quality.get(k) for k in ("machine", "eval_tokens", "calibration")}
    return rows, info
