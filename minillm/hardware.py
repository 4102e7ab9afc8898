"""A small catalog of accelerators, for the labs' "what would this cost on an H100?" questions.

Invariants: every entry is a frozen ``Hardware``; all figures are in bytes, bytes/s, FLOP/s
and US dollars per hour; FLOP/s are dense tensor-core peaks (no 2:4 sparsity), as the
vendors' datasheets state them. ``get(name)`` is the only lookup and fails loudly.

Where the numbers come from:
- Memory, bandwidth and FLOP/s: the vendors' datasheets (NVIDIA A100, H100, H200, A10,
  L40S datasheets; the Ada Lovelace whitepaper for the RTX 4090, whose fp16/bf16 figure is
  the one with fp32 accumulation, as inference kernels use; Apple's M2 Max announcement).
  Capacities are the nominal "80 GB" etc. taken as SI gigabytes (80e9), which is the
  arithmetic the course uses; the real HBM stacks hold GiB (80 GiB = 85.9e9 bytes).
- Interconnect: total bidirectional figures as vendors quote them (NVLink 4: 900 GB/s,
  PCIe 4.0 x16: 64 GB/s).
- price_per_hour: INDICATIVE on-demand rental prices for one GPU, rounded; real prices vary
  2-3x between clouds and over time. A100-80GB is set to the $2.50/h the course's cost
  example uses. The M2 Max is not rented by the hour: its figure is a laptop's purchase
  price spread over three years of continuous use.
- CPU VMs (``instance_prices``, ``price_of_device``): ``DOLLARS_PER_VCPU_HOUR`` per vCPU,
  also indicative; ``price_of_device`` prices the device a lab runs on, for Lab 10.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """One accelerator. FLOP/s are dense peaks; ``fp8_flops`` is None without FP8 support."""

    name: str
    memory_bytes: float
    bandwidth_bytes_per_s: float
    fp16_flops: float
    bf16_flops: float
    fp8_flops: float | None
    price_per_hour: float  # USD, indicative (see module docstring)
    interconnect: str  # how several of them talk to each other
    interconnect_bytes_per_s: float | None = None  # None: no GPU-to-GPU link

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s for ``dtype``: "fp16"/"float16", "bf16"/"bfloat16" or "fp8"."""
        key = str(dtype).removeprefix("torch.").lower()
        table = {"fp16": self.fp16_flops, "float16": self.fp16_flops, "half": self.fp16_flops,
                 "bf16": self.bf16_flops, "bfloat16": self.bf16_flops,
                 "fp8": self.fp8_flops, "float8": self.fp8_flops}
        if key not in table:
            raise ValueError(f"dtype must be one of 'fp16', 'bf16', 'fp8'; got {dtype!r}.")
        if table[key] is None:
            raise ValueError(f"{self.name} has no {key} tensor cores; use 'fp16' or 'bf16' instead.")
        return table[key]

    def ridge_point(self, dtype: str = "bf16") -> float:
        """FLOPs per byte where this chip turns from memory- to compute-bound."""
        return self.peak_flops(dtype) / self.bandwidth_bytes_per_s


_NVLINK3 = "NVLink 3 (SXM4), 600 GB/s"
_NVLINK4 = "NVLink 4, 900 GB/s"
_PCIE4 = "PCIe 4.0 x16, 64 GB/s; no NVLink"

CATALOG: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware("A100-40GB", 40e9, 1.555e12, 312e12, 312e12, None, 1.50, _NVLINK3, 600e9),
        Hardware("A100-80GB", 80e9, 2.039e12, 312e12, 312e12, None, 2.50, _NVLINK3, 600e9),
        Hardware("H100-SXM", 80e9, 3.35e12, 989e12, 989e12, 1979e12, 3.00, _NVLINK4, 900e9),
        Hardware("H200", 141e9, 4.8e12, 989e12, 989e12, 1979e12, 3.80, _NVLINK4, 900e9),
        Hardware("RTX-4090", 24e9, 1.008e12, 165.2e12, 165.2e12, 330.3e12, 0.50, _PCIE4, 64e9),
        Hardware("A10", 24e9, 600e9, 125e12, 125e12, None, 1.00, _PCIE4, 64e9),
        Hardware("L40S", 48e9, 864e9, 362.05e12, 362.05e12, 733e12, 1.50, _PCIE4, 64e9),
        # Apple M2 Max, 38-core GPU, largest (96 GB) unified-memory configuration. Apple
        # publishes 13.6 TFLOP/s fp32; its GPU runs fp16 at the same rate and publishes no
        # separate bf16 figure, so both are set to 13.6e12 (an estimate).
        Hardware("M2-Max", 96e9, 400e9, 13.6e12, 13.6e12, None, 0.15,
                 "unified memory on one chip; no GPU-to-GPU link", None),
    )
}


def get(name: str) -> Hardware:
    """Look up a catalog entry by id (case-insensitive), e.g. ``get("H100-SXM")``."""
    if name in CATALOG:
        return CATALOG[name]
    for key, hw in CATALOG.items():
        if isinstance(name, str) and key.lower() == name.lower():
            return hw
    raise UnknownHardwareError(
        f"unknown hardware {name!r}; valid names: {', '.join(CATALOG)}."
    )


class UnknownHardwareError(KeyError, ValueError):
    """Raised by ``get`` for a name not in ``CATALOG``; catchable as KeyError or ValueError."""

    def __str__(self) -> str:  # KeyError would otherwise show the message in quotes
        return str(self.args[0])


# --------------------------------------------------------------------------- renting a device

#: INDICATIVE on-demand price of one CPU core's worth of a cloud VM (one vCPU, with its
#: share of memory), USD per hour: general-purpose VMs of the large clouds run about
#: $0.04-0.06 per vCPU-hour. A 2-vCPU VM is then $0.10/h.
DOLLARS_PER_VCPU_HOUR = 0.05


def instance_prices(vcpus: tuple[int, ...] = (2, 8, 32)) -> list[tuple[str, float]]:
    """(instance, indicative $/h) to rent by the hour: CPU VMs of ``vcpus`` vCPUs, then one
    of each catalog GPU (its ``price_per_hour``; the M2 Max, bought not rented, left out)."""
    rows = [(f"CPU VM, {n} vCPUs", n * DOLLARS_PER_VCPU_HOUR) for n in vcpus]
    rows += [(f"1 × {hw.name}", hw.price_per_hour) for hw in CATALOG.values()
             if hw.name != "M2-Max"]
    return rows


def catalog_name_of(gpu_name: str) -> str | None:
    """The catalog entry a GPU's own name (``torch.cuda.get_device_name``) is, e.g.
    "NVIDIA H100 80GB HBM3" -> "H100-SXM"; None when none matches."""
    n = gpu_name.upper().replace(" ", "").replace("-", "")
    if "A100" in n:
        return "A100-80GB" if "80GB" in n else "A100-40GB"
    for key, entry in (("H200", "H200"), ("H100", "H100-SXM"), ("L40S", "L40S"),
                       ("4090", "RTX-4090"), ("A10", "A10")):
        if key in n:
            return entry
    return None


def price_of_device(device=None, vcpus: int | None = None) -> tuple[str, float | None]:
    """(what it is, indicative $/h) for renting ``device`` (None: the default device): a
    catalog GPU's price (a GPU not in the catalog gets the catalog's median GPU price, and
    the label says so), else a CPU VM of ``vcpus`` vCPUs (None: this process's torch
    threads) at ``DOLLARS_PER_VCPU_HOUR``."""
    import torch

    from .devices import device_name, resolve_device

    dev = resolve_device(device)
    if dev.type == "cuda":
        name = device_name(dev)
        key = catalog_name_of(name)
        if key is None:  # priced like the catalog's middle GPU, and said so
            prices = sorted(p for _, p in instance_prices(()))
            return (f"{name} (not in the catalog: priced at the catalog's median GPU)",
                    prices[len(prices) // 2])
        return f"1 × {key} ({name})", CATALOG[key].price_per_hour
    n = vcpus or torch.get_num_threads()
    return f"a CPU VM of {n} vCPUs", n * DOLLARS_PER_VCPU_HOUR
