"""The tolerance of a compiled attend against the torch reference, one per output dtype.

Both sides read the same cache bytes (fp8 decoded exactly) and accumulate in fp32, so what differs
is the order of the sums, the GPU kernels' exp/reciprocal approximations, the matrix-core
variants' products in 16 bits (P rounded to bf16 or f16, an fp8 cache's values and the query in
f16) and the output's rounding. The bounds are vLLM's own for its sparse attend
(tests of `minimax_m3` in vLLM: max abs error < 1.7e-2, mean < 2.5e-4), for outputs of O(1) (the
cases' queries and keys are N(0, 1)); f16 outputs round finer than bf16, so bf16's bound holds
for both. Portable (host) kernels do the reference's fp32 math: they are also held to one
rounding of the output (PORTABLE_RTOL).
"""
import torch

MAX_ABS = {torch.bfloat16: 1.7e-2, torch.float16: 1.7e-2}
MEAN_ABS = {torch.bfloat16: 2.5e-4, torch.float16: 2.5e-4}
PORTABLE_RTOL = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -9}


def attend_errors(got: torch.Tensor, ref: torch.Tensor):
    err = (got.float().cpu() - ref.float().cpu()).abs()
    return float(err.max()) if err.numel() else 0.0, float(err.mean()) if err.numel() else 0.0


def assert_attend_close(got: torch.Tensor, ref: torch.Tensor, what=""):
    """`got` (a compiled attend's output rows) within the tolerance of the reference's `ref`."""
    assert not got.isnan().any(), f"{what}: NaN in the output"
    worst, mean = attend_errors(got, ref)
    assert worst < MAX_ABS[got.dtype] and mean < MEAN_ABS[got.dtype], (what, worst, mean)
