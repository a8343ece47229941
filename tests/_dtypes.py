"""Dtypes and seeded tensors shared by the checkpoint test files."""

import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]


def seeded(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Reproducible values of any DTYPES dtype (negative ones where signed)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    low = 0 if dtype == torch.uint8 else -100
    return torch.randint(low, 100, shape, generator=g).to(dtype)
