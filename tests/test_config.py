import pytest

from msa_iree.config import MsaConfig, resolve_dtype


def test_defaults_are_minimax_m3_tp4():
    c = MsaConfig()
    assert (c.num_heads, c.num_kv_heads, c.group_size, c.max_context, c.pages_per_block) == (16, 1, 16, 2048, 8)


@pytest.mark.parametrize("kw, match", [
    (dict(head_dim=64), "head_dim: expected 128.*64"),
    (dict(num_heads=16, num_kv_heads=3), "num_heads: expected a positive multiple of num_kv_heads=3, got 16"),
    (dict(kv_dtype="fp8"), "kv_dtype"),
    (dict(query_dtype="fp8_e4m3fn"), "query_dtype"),
    (dict(page_size=32), "page_size"),
    (dict(decode_query_len=0), "decode_query_len"),
])
def test_validation_names_the_values(kw, match):
    with pytest.raises(ValueError, match=match):
        MsaConfig(**kw)


def test_fp8_resolves_per_target():
    assert resolve_dtype("fp8", "gfx942") == "fp8_e4m3fnuz"
    assert resolve_dtype("fp8", "gfx950") == "fp8_e4m3fn"
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int4")
