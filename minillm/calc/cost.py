"""Cost: dollars per million tokens on a rented GPU, and when renting beats an API."""

from __future__ import annotations

from ._common import _real

#: Average hours in a calendar month (8760 h / 12), the figure cloud bills use.
HOURS_PER_MONTH = 730


def cost_per_million_tokens(dollars_per_hour, tokens_per_s) -> float:
    """Dollars per 1M generated tokens: ``$/h ÷ (tok/s · 3600) × 1e6``.

    One A100 at $2.50/h serving 800 tok/s: $0.87 per million tokens.
    """
    return _real("dollars_per_hour", dollars_per_hour) / (_real("tokens_per_s", tokens_per_s) * 3600) * 1e6


def break_even_tokens_per_month(gpu_dollars_per_month, api_dollars_per_million_tokens) -> float:
    """Monthly tokens above which renting the GPU beats paying the API:
    ``gpu $/month ÷ api $/token`` = ``gpu $/month ÷ (api $/1M) × 1e6``.

    Only meaningful if the GPU can serve that many: compare with ``tok/s · 3600 ·
    HOURS_PER_MONTH``.
    """
    gpu = _real("gpu_dollars_per_month", gpu_dollars_per_month, allow_zero=True)
    api = _real("api_dollars_per_million_tokens", api_dollars_per_million_tokens)
    return gpu / api * 1e6
