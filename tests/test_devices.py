"""Where inputs go, and which devices multiply bfloat16 natively."""

import torch

from prune_heads.runtime.devices import native_bfloat16


def test_native_bfloat16_follows_the_cpu_instructions_and_the_gpu():
    expected = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert native_bfloat16("cpu") is expected
    assert native_bfloat16("meta") is False
    assert native_bfloat16("cuda") is (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
