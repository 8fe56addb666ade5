"""SHUFFLE page-16 views: element placement, round trips, strides, fp8 conversions."""
import pytest
import torch

from msa_iree import layout as L

DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fnuz, torch.float8_e4m3fn]


def random_logical(nb, h, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(nb, 128, h, 128, generator=g).to(dtype), torch.randn(nb, 128, h, 128, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", L.LAYOUTS)
@pytest.mark.parametrize("heads", [1, 2])
def test_round_trip(dtype, layout, heads):
    k, v = random_logical(3, heads, dtype)
    kc, vc = L.pack_kv_cache(k, v, layout)
    k2, v2 = L.unpack_kv_cache(kc, vc)
    assert torch.equal(k2.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(v2.view(torch.uint8), v.view(torch.uint8))


def test_worked_example_shapes_fp8_interleaved():
    kc, vc = L.allocate_kv_cache(3, 1, torch.float8_e4m3fnuz, "interleaved")
    assert tuple(kc.shape) == (48, 1, 8, 16, 16) and tuple(vc.shape) == (40, 1, 1, 128, 16)
    assert L.block_page_stride(kc, vc) == 16
    kc, vc = L.allocate_kv_cache(3, 1, torch.bfloat16, "planes")
    assert tuple(kc.shape) == (24, 1, 16, 16, 8) and tuple(vc.shape) == (24, 1, 2, 128, 8)
    assert L.block_page_stride(kc, vc) == 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("layout", L.LAYOUTS)
def test_element_placement(dtype, layout):
    """K(b, o, h, d) at k[P, h, d//x, s, d%x]; V at v[P, h, s//x, d, s%x]; P = b*stride + o//16."""
    k, v = random_logical(2, 2, dtype, seed=1)
    kc, vc = L.pack_kv_cache(k, v, layout)
    x = L.elements_per_16_bytes(dtype)
    stride = 16 if layout == "interleaved" else 8
    for b, o, h, d in [(0, 0, 0, 0), (1, 17, 1, 127), (1, 127, 0, 9), (0, 64, 1, 100)]:
        P, s = b * stride + o // 16, o % 16
        assert kc[P, h, d // x, s, d % x].float() == k[b, o, h, d].float()
        assert vc[P, h, s // x, d, s % x].float() == v[b, o, h, d].float()


def test_interleaved_v_page_is_raw_page_plus_8():
    k, v = random_logical(2, 1, torch.float8_e4m3fn, seed=2)
    kc, vc = L.pack_kv_cache(k, v, "interleaved")
    raw = kc.reshape(32, -1)  # the buffer starts at K page 0
    assert vc.data_ptr() == raw[8].data_ptr()
    assert torch.equal(raw[16 + 8 + 3].view(torch.uint8), vc[16 + 3].reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fnuz, torch.float8_e4m3fn])
def test_fp8_quantize_with_scale(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1000, generator=g) * 5
    scale = torch.tensor([0.1])  # |x|/scale stays inside both formats (fnuz max 240)
    q = L.quantize_fp8(x, scale, dtype)
    assert q.dtype == dtype
    err = (L.dequantize_fp8(q, scale) - x).abs()
    assert (err <= x.abs() * 2 ** -4 + 0.1 * 2 ** -9).all()  # half an ulp of 3 mantissa bits, subnormal floor
    big = L.quantize_fp8(torch.tensor([1e9, -1e9]), 1.0, dtype).float()
    assert big.tolist() == [torch.finfo(dtype).max, -torch.finfo(dtype).max]  # saturated, not NaN


def test_fp8_formats_are_not_interchangeable():
    x = torch.tensor([1.0, -2.5, 96.0])
    fnuz = L.quantize_fp8(x, 1.0, torch.float8_e4m3fnuz)
    as_fn = fnuz.view(torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(fnuz.float(), x) and torch.equal(as_fn, x * 2)  # same bytes, twice the value (bias 8 vs 7)


def test_per_token_scale_reads_head_and_slot():
    s = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    assert L.per_token_scale(s, torch.tensor([0, 5]), 1).tolist() == [6.0, 11.0]


def test_logical_slots_of_pages():
    pages = torch.tensor([0, 7, 16, 23])
    assert L.logical_slots_of_pages(pages, 16).tolist() == [0, 112, 128, 240]
    assert L.logical_slots_of_pages(torch.tensor([8, 15]), 8).tolist() == [128, 240]


def test_cli_layout_strides_match_the_layout():
    from msa_iree import cli, layout
    assert cli.LAYOUT_STRIDES == layout.LAYOUT_STRIDES
