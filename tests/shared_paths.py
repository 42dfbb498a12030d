"""Where the project's shared/ folder is: beside the checkout (CI's layout), else the dev machines' /work/shared."""

from __future__ import annotations

from pathlib import Path

_BESIDE_CHECKOUT = Path(__file__).resolve().parents[2] / "shared"
SHARED = _BESIDE_CHECKOUT if (_BESIDE_CHECKOUT / "fixtures").exists() else Path("/work/shared")
FIXTURES = SHARED / "fixtures"
QWEN3_FIXTURE_DIR = FIXTURES / "qwen3-0.6b"
