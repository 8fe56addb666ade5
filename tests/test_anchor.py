"""The anchor's side of the benchmark on the CPU: vLLM's cache layout holds the benchmark's
K/V values bit for bit, and a missing anchor file is refused by name. (The Triton kernels
themselves run only on the GPU machine, in the benchmark.)"""
import pytest
import torch

from benchmarks import anchor
from msa_iree.layout import pack_kv_cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_vllm_cache_holds_k_then_v_of_each_block_token_and_head(dtype):
    blocks, heads = 3, 2
    b, s, h, d = torch.meshgrid(*(torch.arange(n) for n in (blocks, 128, heads, 128)), indexing="ij")
    # distinct small integers (exact in fp8 e4m3fn: |x| <= 15 with 3 mantissa bits needs x < 16)
    k = ((b * 5 + s % 7 + h * 3 + d % 4) % 15).float()
    v = -((b * 3 + s % 5 + h + d % 6) % 15).float()
    k_cache, v_cache = pack_kv_cache(k.to(dtype), v.to(dtype))
    kv = anchor.vllm_kv_cache(k_cache, v_cache)
    assert kv.shape == (blocks, heads, 128, 256) and kv.dtype == dtype
    for bi, si, hi in [(0, 0, 0), (2, 127, 1), (1, 16, 0), (1, 15, 1), (2, 64, 0)]:
        assert torch.equal(kv[bi, hi, si, :128].float(), k[bi, si, hi]), (bi, si, hi)
        assert torch.equal(kv[bi, hi, si, 128:].float(), v[bi, si, hi]), (bi, si, hi)
    assert torch.equal(kv[..., :128].float(), k.permute(0, 2, 1, 3))
    assert torch.equal(kv[..., 128:].float(), v.permute(0, 2, 1, 3))


def test_a_missing_anchor_file_is_refused_by_name(tmp_path):
    missing = tmp_path / "sparse_attn.py"
    with pytest.raises(FileNotFoundError, match="sparse_attn.py"):
        anchor.load_triton_module(str(missing))
