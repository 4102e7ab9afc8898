"""The checks students call: ``from quizzes import check; check.softmax(my_softmax)``.

Each lab's checks live in their own module here (``lab02.py``, ...) or, when they are
long, in a subpackage (``lab03/``), registered with ``@register``; they appear as
attributes of this package the first time any check is looked up (every module and
subpackage except the framework's own, ``core.INFRA_MODULES``, is imported then).
Nothing else needs editing to add a lab's checks. ``register(nudge=..., concept=...)`` sets a
check's hint ladder (see ``core``); ``attempts`` counts the wrong attempts per check. ``generic`` holds checks that any lab
may use (softmax, matvec, greedy_pick) and that the machinery's own tests exercise.
"""

from __future__ import annotations

import importlib
import pkgutil

from .core import INFRA_MODULES as _INFRA
from .core import Case, CheckFailed, NotImplementedYet, attempts, compare, describe, register, registry
from .mismatch import show_mismatch

__all__ = ["Case", "CheckFailed", "NotImplementedYet", "attempts", "compare", "describe", "register", "registry",
           "show_mismatch", "available"]

_load_errors: dict[str, str] = {}  # file or folder -> the error that stopped its import
_loaded = False


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name in _INFRA or mod.name.startswith("_"):
            continue
        try:
            importlib.import_module(f"{__name__}.{mod.name}")
        except Exception as exc:  # keep other labs' checks usable; report on lookup
            where = f"quizzes/checks/{mod.name}" + ("/" if mod.ispkg else ".py")
            _load_errors[where] = f"{type(exc).__name__}: {exc}"


def available() -> list[str]:
    """Names of all registered checks."""
    _load_all()
    return sorted(registry)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    _load_all()
    if name in registry:
        return registry[name]
    msg = f"there is no check named {name!r}. Available: {', '.join(sorted(registry)) or 'none'}."
    if _load_errors:
        broken = "; ".join(f"{where}: {e}" for where, e in _load_errors.items())
        msg += f" (Some check modules failed to import: {broken})"
    raise AttributeError(msg)


def __dir__() -> list[str]:
    _load_all()
    return sorted(set(globals()) | set(registry))
