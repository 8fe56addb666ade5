"""The GPU attend's fp8 decode (msa_iree/ops/templates/fp8_word_decode.j2), compiled for the host CPU from
the same template text the mma kernel includes, against torch's own fp8 decode: every byte value
in every position of the word, plus seeded random words. Four bytes decode into two f16 pairs,
bytes (0, 2) and (1, 3), each value times 2^-8 (e4m3fn) or 2^-7 (e4m3fnuz); NaN codes to NaN.
Also the CUDA twin's software stand-in for gfx942's e4m3fnuz converter (fnuz_word_f16 with
EMULATE): bytes 0, 1, 2, 3 in order, exact."""
import numpy as np
import pytest
import torch

from msa_iree.compile import compile_mlir
from msa_iree.ops.spec import _template_env

def _harness(body: str) -> str:
    """A host function mapping i32 words to two i32 results; `body` decodes %x and yields them."""
    return """
{%- from "fp8_word_decode.j2" import decode_word_constants, decode_word_f16, fnuz_word_f16 with context %}
#map = affine_map<(d0) -> (d0)>
func.func @main(%w: tensor<?xi32>) -> (tensor<?xi32>, tensor<?xi32>) {
  %c0 = arith.constant 0 : index
  %n = tensor.dim %w, %c0 : tensor<?xi32>
  %e = tensor.empty(%n) : tensor<?xi32>
  %r:2 = linalg.generic {indexing_maps = [#map, #map, #map], iterator_types = ["parallel"]}
      ins(%w : tensor<?xi32>) outs(%e, %e : tensor<?xi32>, tensor<?xi32>) {
  ^bb0(%x: i32, %o0: i32, %o1: i32):
{{ decode_word_constants() }}
""" + body + """
  } -> (tensor<?xi32>, tensor<?xi32>)
  return %r#0, %r#1 : tensor<?xi32>, tensor<?xi32>
}
"""


# the integer decode: two f16 pairs as i32 words
HARNESS = _harness("""{{ decode_word_f16("d", "x") }}
    linalg.yield %d_a, %d_b : i32, i32""")

FORMATS = {"fn": (torch.float8_e4m3fn, 2.0 ** 8), "fnuz": (torch.float8_e4m3fnuz, 2.0 ** 7)}


@pytest.fixture(scope="module")
def decode_module():
    import iree.runtime as rt

    modules = {}
    for fmt in FORMATS:
        vmfb = compile_mlir(_template_env().from_string(HARNESS).render(FP8=fmt, AMDCVT=False, EMULATE=False), "host")
        ctx = rt.SystemContext(config=rt.Config("local-task"))
        ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb))
        modules[fmt] = ctx.modules.module["main"]
    return modules


def _words():
    """Every byte value in each of the four positions (the others random), then random words."""
    g = np.random.default_rng(7)
    words = []
    for pos in range(4):
        b = g.integers(0, 256, (256, 4), dtype=np.uint8)
        b[:, pos] = np.arange(256, dtype=np.uint8)
        words.append(b)
    words.append(g.integers(0, 256, (20000, 4), dtype=np.uint8))
    return np.concatenate(words)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_word_decode_matches_torch_for_every_byte(decode_module, fmt):
    dtype, rebias = FORMATS[fmt]
    raw = _words()                                                    # [N, 4] bytes, little endian in the word
    lo, hi = decode_module[fmt](raw.view(np.int32).reshape(-1))
    lo = np.asarray(lo.to_host() if hasattr(lo, "to_host") else lo).astype(np.int32)
    hi = np.asarray(hi.to_host() if hasattr(hi, "to_host") else hi).astype(np.int32)
    got = np.stack([lo.view(np.float16).reshape(-1, 2), hi.view(np.float16).reshape(-1, 2)], 1).reshape(-1, 4)
    got = torch.from_numpy(got.astype(np.float32)) * rebias           # columns: bytes 0, 2, 1, 3
    want = torch.from_numpy(raw).view(dtype).float()[:, [0, 2, 1, 3]]
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan], want[~nan])
    assert torch.equal(got[~nan].signbit(), want[~nan].signbit())   # -0 stays -0 (e4m3fn 0x80)


# the stand-in for gfx942's converter: vector<4xf16> (bytes 0..3) as two i32 words
FNUZ_HW_HARNESS = _harness("""{{ fnuz_word_f16("d", "x") }}
    %d_i = vector.bitcast %d : vector<4xf16> to vector<2xi32>
    %d_01 = vector.extract %d_i[0] : i32 from vector<2xi32>
    %d_23 = vector.extract %d_i[1] : i32 from vector<2xi32>
    linalg.yield %d_01, %d_23 : i32, i32""")


def test_emulated_fnuz_converter_matches_torch_for_every_byte():
    """The stand-in the CUDA twin of gfx942's MFMA attend runs for v_cvt_pk_f32_fp8 + v_cvt_pkrtz_f16_f32
    (which no test here can run): the word's four bytes as e4m3fnuz values, exact, in byte order."""
    import iree.runtime as rt

    text = _template_env().from_string(FNUZ_HW_HARNESS).render(FP8="fnuz", AMDCVT=True, EMULATE=True)
    ctx = rt.SystemContext(config=rt.Config("local-task"))
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, compile_mlir(text, "host")))
    raw = _words()
    w01, w23 = ctx.modules.module["main"](raw.view(np.int32).reshape(-1))
    w01 = np.asarray(w01.to_host() if hasattr(w01, "to_host") else w01).astype(np.int32)
    w23 = np.asarray(w23.to_host() if hasattr(w23, "to_host") else w23).astype(np.int32)
    got = np.stack([w01, w23], 1).view(np.float16).reshape(-1, 4)
    got = torch.from_numpy(got.astype(np.float32))                    # columns: bytes 0, 1, 2, 3
    want = torch.from_numpy(raw).view(torch.float8_e4m3fnuz).float()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan], want[~nan])
