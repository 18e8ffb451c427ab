"""The LoRA shrink and expand kernels (ops/triton_lora.py) match their torch references under the Triton
interpreter (in a subprocess: triton_lora_checks.py), for a batch mixing every slot and the base model."""

from __future__ import annotations

from pathlib import Path

import pytest
from kernel_device import device, run_checks

CHECKS = Path(__file__).with_name("triton_lora_checks.py")


@pytest.fixture(scope="module")
def results():
    found = run_checks(CHECKS, timeout=240)
    assert {r["device"] for r in found} == {device()}
    return found


@pytest.mark.parametrize("kernel", ["lora_shrink", "lora_expand"])
def test_lora_kernel_matches_its_torch_reference(results, kernel):
    mine = [r for r in results if r["name"].startswith(kernel)]
    assert len(mine) == 3, [r["name"] for r in results]
    failed = [f"{r['name']}: {r['detail']}" for r in mine if not r["ok"]]
    assert not failed, "kernel differs from its torch reference:\n" + "\n".join(failed)
