#!/usr/bin/env python3
"""There: one forward and one backward of torch SDPA's FLASH backend on a docs/ARCHITECTURE.md shape
(16k tokens, hidden 2048, bf16), for a profiler to catch its kernels.
Usage: python3 torch_step.py D S [causal]"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

d, s = int(sys.argv[1]), int(sys.argv[2])
causal = len(sys.argv) > 3 and sys.argv[3] == "causal"
b, h = 16384 // s, 2048 // d
q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
for t in (q, k, v):
    t.requires_grad_(True)
with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    torch.autograd.grad(o, (q, k, v), do.transpose(1, 2))
torch.cuda.synchronize()
