"""Where the benches find the project's shared folder: ``shared/`` beside the checkout (the layout CI and the
benchmark machines use), its fixtures overridable with ``$SPLITSERVE_FIXTURES``."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
FIXTURES = Path(os.environ["SPLITSERVE_FIXTURES"]) if os.environ.get("SPLITSERVE_FIXTURES") else SHARED / "fixtures"
QWEN3_DIR = FIXTURES / "qwen3-0.6b"  # the Qwen3-0.6B tokenizer and chat template the benches render with
