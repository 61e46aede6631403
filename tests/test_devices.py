"""Where inputs go, and which devices multiply bfloat16 natively."""

from pathlib import Path

import pytest
import torch

from prune_heads.runtime.devices import native_bfloat16

CPUINFO = Path("/proc/cpuinfo")


@pytest.mark.skipif(not CPUINFO.exists(), reason="reads the CPU's flags from /proc/cpuinfo (Linux)")
def test_native_bfloat16_on_the_cpu_is_what_its_instruction_flags_say():
    """The kernel's list of the CPU's instructions, not torch's probes the code itself asks, decides the answer."""
    flags = set(next(line for line in CPUINFO.read_text().splitlines() if line.startswith("flags")).split())
    assert native_bfloat16("cpu") is bool({"avx512_bf16", "amx_tile"} & flags)


@pytest.mark.parametrize("avx512, amx", [(False, False), (True, False), (False, True)])
def test_either_instruction_set_is_enough_and_other_devices_are_not_native(monkeypatch, avx512, amx):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert native_bfloat16("cpu") is (avx512 or amx)
    assert native_bfloat16("meta") is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert native_bfloat16("cuda") is False
