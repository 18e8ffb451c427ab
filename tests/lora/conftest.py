"""LoRA tests: adapters made with `peft` (a test-only package, installed into a temporary target on
sys.path, never into .venv) on the tiny random models, saved once per test module."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PEFT_VERSION = "0.21.2"


@pytest.fixture(scope="session")
def peft(tmp_path_factory):
    try:
        return importlib.import_module("peft")
    except ImportError:
        pass
    target = tmp_path_factory.mktemp("peft-target")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                    f"peft=={PEFT_VERSION}"], check=True, capture_output=True, text=True, timeout=300)
    sys.path.insert(0, str(target))
    return importlib.import_module("peft")
