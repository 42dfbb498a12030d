"""Where the project's shared/ folder is: beside the checkout (the layout CI and every test machine use)."""

from __future__ import annotations

from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
FIXTURES = SHARED / "fixtures"
QWEN3_FIXTURE_DIR = FIXTURES / "qwen3-0.6b"
