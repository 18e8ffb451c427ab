"""Run these tests from a checkout without installing the plugin: its src/ goes on sys.path."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
