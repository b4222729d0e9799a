"""Where the tests find the project: its root, the bundled models, the recorded fixtures."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
FIXTURES = Path(__file__).resolve().parent / "fixtures"  # recorded from real engines: each has a README
