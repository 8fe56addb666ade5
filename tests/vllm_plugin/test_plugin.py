"""msa-iree inside vLLM 0.33.0, on the CPU: the plugin's selection, its metadata builder against
vLLM's own AITER builder, and its impl inside a vLLM forward context against the reference.

Runs in an environment with vLLM installed (.ci/run makes one; tests/test_vllm_env.py runs this
file there). The kernels are msa-iree's host build, made by `msa-iree compile` in a session
fixture and handed to the plugin through MSA_IREE_VLLM_BUILD.
"""
import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM 0.33.0 (the environment .ci/run makes)")

from vllm.forward_context import ForwardContext, override_forward_context  # noqa: E402
from vllm.models.minimax_m3.amd import model as amd_model  # noqa: E402
from vllm.models.minimax_m3.amd import sparse_attention_msa as aiter  # noqa: E402
from vllm.models.minimax_m3.common import sparse_attention as common  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from msa_iree import reference as R  # noqa: E402

BF16, FNUZ, FN = torch.bfloat16, torch.float8_e4m3fnuz, torch.float8_e4m3fn
SCALE = 128 ** -0.5
TOL = 1.7e-2  # tests/tolerances.py: vLLM's own bound for its sparse attend


# ---- the kernels and the plugin ----

@pytest.fixture(scope="session")
def build_dir(tmp_path_factory):
    """The host kernels the tests serve with, built by the documented command (a vLLM TP4 fp8
    configuration with its bf16 indexer, and with an fp8 one, and the e4m3fn and two-KV-head sets
    the other cases use)."""
    out = tmp_path_factory.mktemp("msa-iree-host")
    cmd = [sys.executable, "-m", "msa_iree", "compile", "--target", "host", "--out", str(out)]
    for extra in (["--tensor-parallel-size", "4", "--kv-cache-dtype", "fp8", "--num-speculative-tokens", "3",
                   "--index-cache-dtype", "bf16"],
                  ["--tensor-parallel-size", "4", "--kv-cache-dtype", "fp8", "--num-speculative-tokens", "3",
                   "--index-cache-dtype", "fp8_e4m3fn"],
                  ["--num-heads", "16", "--num-kv-heads", "1", "--kv-dtype", "fp8_e4m3fn", "--decode-query-lens", "1",
                   "--layouts", "interleaved"],
                  ["--num-heads", "32", "--num-kv-heads", "2", "--kv-dtype", "bf16", "--decode-query-lens", "1,4"]):
        r = subprocess.run(cmd + extra, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
    return out


@pytest.fixture
def plugin(build_dir, monkeypatch):
    """The plugin loaded the way vLLM loads it (its general plugins), opted in."""
    import msa_iree.vllm as plugin_pkg
    import vllm.plugins
    from msa_iree.vllm import backend

    backend.kernel_library.cache_clear()
    monkeypatch.setenv("MSA_IREE_VLLM", "1")
    monkeypatch.setenv("MSA_IREE_VLLM_BUILD", str(build_dir))
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setattr(plugin_pkg, "_registered", False)
    vllm.plugins.load_general_plugins()
    yield backend
    backend.uninstall()
    backend.kernel_library.cache_clear()


def test_without_the_variable_vllm_selects_as_it_does(monkeypatch):
    import msa_iree.vllm as plugin_pkg
    import vllm.plugins

    own = common.select_main_backend_and_impl_cls
    monkeypatch.delenv("MSA_IREE_VLLM", raising=False)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setattr(plugin_pkg, "_registered", False)
    vllm.plugins.load_general_plugins()
    assert common.select_main_backend_and_impl_cls is own and amd_model.select_main_backend_and_impl_cls is own
    backend_cls, impl_cls = own(topk_blocks=16, kv_cache_dtype="fp8", num_kv_heads=1)
    assert backend_cls.get_name() == "MINIMAX_M3_SPARSE" and impl_cls.__name__ == "MiniMaxM3SparseTritonImpl"


def test_the_plugin_selects_msa_iree_where_it_serves(plugin):
    for select in (common.select_main_backend_and_impl_cls, amd_model.select_main_backend_and_impl_cls):
        backend_cls, impl_cls = select(topk_blocks=16, kv_cache_dtype="fp8", num_kv_heads=2)
        assert backend_cls is plugin.MsaIreeBackend and impl_cls is plugin.MsaIreeImpl
        assert amd_model.minimax_m3_use_aiter_sparse_pa(2) is True  # the page-16 views, two KV heads a rank
    assert issubclass(plugin.MsaIreeImpl, aiter.MiniMaxM3SparseAiterPAImpl)  # the model's assert holds
    assert plugin.MsaIreeBackend.get_builder_cls() is plugin.MsaIreeMetadataBuilder
    # what msa-iree does not build goes to vLLM's own choice (Triton here)
    for kw in (dict(kv_cache_dtype="fp8_e5m2", topk_blocks=16), dict(kv_cache_dtype="fp8", topk_blocks=8)):
        backend_cls, impl_cls = amd_model.select_main_backend_and_impl_cls(num_kv_heads=1, **kw)
        assert impl_cls.__name__ == "MiniMaxM3SparseTritonImpl"
        assert not amd_model.minimax_m3_use_aiter_sparse_pa(1)  # vLLM's own gate: no AITER here


def test_a_vllm_of_another_version_is_refused(plugin, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.raises(RuntimeError, match="expected vLLM 0.33.0 .*, got 0.34.0; unset MSA_IREE_VLLM"):
        plugin.check_vllm_version()


@pytest.mark.parametrize("kw, match", [
    (dict(head_size=64), "requires head_dim == 128, got 64"),
    (dict(topk_blocks=8), "topk_blocks=8 is not built"),
    (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype='fp8_e5m2' is not built"),
    (dict(sparse_block_size=64), "requires sparse_block_size == 128, got 64"),
])
def test_bad_configurations_are_refused(plugin, kw, match):
    args = dict(num_heads=16, head_size=128, scale=SCALE, num_kv_heads=1, kv_cache_dtype="fp8", topk_blocks=16,
                sparse_block_size=128)
    args.update(kw)
    num_heads, head_size, scale = args.pop("num_heads"), args.pop("head_size"), args.pop("scale")
    with pytest.raises(ValueError, match=match):
        plugin.MsaIreeImpl(num_heads, head_size, scale, **args)


def test_no_build_directory_is_an_error_naming_the_command(plugin, monkeypatch):
    plugin.kernel_library.cache_clear()
    monkeypatch.delenv("MSA_IREE_VLLM_BUILD")
    with pytest.raises(RuntimeError, match="MSA_IREE_VLLM_BUILD: expected the build directory of `msa-iree compile"):
        plugin.MsaIreeImpl(16, 128, SCALE, 1, "fp8", topk_blocks=16, sparse_block_size=128)


# ---- the metadata builder ----

def vllm_config(max_num_seqs=8, max_model_len=4096, tokens=256):
    return types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=tokens),
        model_config=types.SimpleNamespace(max_model_len=max_model_len), speculative_config=None,
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=1))


def common_metadata(block_table, seq_lens, qlens, slot_mapping, num_actual_tokens=None):
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    n = int(qsl[-1]) if num_actual_tokens is None else num_actual_tokens
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, seq_lens_cpu_upper_bound=seq.clone(),
        num_reqs=len(seq_lens), num_actual_tokens=n, max_query_len=max(qlens), max_seq_len=max(seq_lens),
        block_table_tensor=torch.tensor(block_table, dtype=torch.int32),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64))


SPEC = types.SimpleNamespace(block_size=128)


def steps():
    """(name, CommonAttentionMetadata): decode, speculative decode (L = 4), mixed, padded."""
    bt = [[5, 9, 2], [7, 1, 3], [4, 6, 8], [0, 0, 0]]
    yield "decode", common_metadata(bt[:3], [300, 129, 1], [1, 1, 1], [2 * 128 + 43, 1 * 128 + 0, 4 * 128])
    yield "spec-decode", common_metadata(bt[:2], [300, 132], [4, 4],
                                         [2 * 128 + 40 + i for i in range(4)] + [1 * 128 + i for i in range(4)])
    yield "mixed", common_metadata(bt[:3], [300, 260, 70], [1, 60, 70],
                                   [2 * 128 + 43] + [3 * 128 + 140 - 128 + i for i in range(60)]
                                   + [4 * 128 + i for i in range(70)])
    yield "padded", common_metadata(bt, [300, 129, 0, 0], [1, 1, 0, 0], [2 * 128 + 43, 1 * 128 + 0, -1, -1],
                                    num_actual_tokens=4)


@pytest.mark.parametrize("name, cm", list(steps()), ids=[n for n, _ in steps()])
def test_the_builder_gives_what_vllms_aiter_builder_gives(plugin, monkeypatch, name, cm):
    """Both builders on one CommonAttentionMetadata: vLLM's AITER builder (its torch rebases,
    made to believe AITER is there) and msa-iree's (its rebases and step plan)."""
    monkeypatch.setattr(common, "_minimax_m3_aiter_sparse_pa_requested", lambda: True)
    theirs = aiter.MiniMaxM3SparseAiterPAMetadataBuilder(SPEC, ["layer.0"], vllm_config(), torch.device("cpu"))
    ours = plugin.MsaIreeMetadataBuilder(SPEC, ["layer.0"], vllm_config(), torch.device("cpu"))
    a, b = theirs.build(0, cm), ours.build(0, cm)
    for f in ("num_actual_tokens", "num_decodes", "num_decode_tokens", "num_prefills", "num_prefill_tokens",
              "max_seq_len"):
        assert getattr(a, f) == getattr(b, f), f
    assert torch.equal(a.page16_slot_mapping.int(), b.page16_slot_mapping), "page16_slot_mapping"
    for part in ("decode", "prefill"):
        x, y = getattr(a, part), getattr(b, part)
        assert (x is None) == (y is None), part
        if x is None:
            continue
        for f, v in vars(x).items():
            w = getattr(y, f)
            assert (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w), (part, f)
    plan = b.msa
    assert plan.num_actual_tokens == a.num_actual_tokens
    if a.prefill is not None:  # the plan's own positions, computed apart from vLLM's
        assert torch.equal(plan.prefill.query_abs_pos, a.prefill.query_abs_pos)
        assert torch.equal(plan.prefill.query_req_id, a.prefill.query_req_id)
    if a.decode is not None:
        assert torch.equal(plan.decode.seq_lens, a.decode.seq_lens)


# ---- the impl inside a forward context ----

def vllm_layer(kv_dtype, num_kv_heads, layout, impl, num_blocks=12, topk_rows=256, per_token_scales=False):
    """What the impl reads off vLLM's MiniMax-M3 layer: its cache as vLLM allocates it ([blocks, 2,
    128, H * 128], raw bytes for fp8; LBHNC interleaves a block's K and V, LHBNC stores planes),
    viewed by vLLM's own `_ensure_aiter_sparse_pa_kv_cache`, the shared top-k buffer, the scales."""
    c = num_kv_heads * 128
    storage = torch.uint8 if kv_dtype in (FNUZ, FN) else kv_dtype
    if layout == "interleaved":
        raw = torch.empty(num_blocks, 2, 128, c, dtype=storage)
    else:
        raw = torch.empty(2, num_blocks, 128, c, dtype=storage).transpose(0, 1)
    g = torch.Generator().manual_seed(11)
    values = torch.randn(raw.shape, generator=g)  # O(1) stored values: outputs of O(1), the tolerance's scale
    raw.copy_(values.to(FNUZ if kv_dtype == FNUZ else FN).view(torch.uint8) if storage == torch.uint8 else values)
    layer = types.SimpleNamespace(
        layer_name="model.layers.3.self_attn.attn", kv_cache=raw,
        kv_cache_dtype="fp8" if storage == torch.uint8 else "auto", impl=impl, head_dim=128,
        num_kv_heads=num_kv_heads, _aiter_sparse_pa_cache_data_ptr=0,
        topk_indices_buffer=torch.full((num_kv_heads, topk_rows, 16), -1, dtype=torch.int32),
        sparse_bt_buffer=None, sparse_ctx_buffer=None,
        _k_scale=torch.tensor(0.37), _v_scale=torch.tensor(1.9))
    if per_token_scales:  # [H, cache tokens], by logical slot
        layer._k_scale, layer._v_scale = (0.1 + torch.rand(num_kv_heads, num_blocks * 128, generator=g) for _ in range(2))
    cls = amd_model.MiniMaxM3SparseAttention
    layer._ensure_aiter_sparse_pa_kv_cache = lambda: cls._ensure_aiter_sparse_pa_kv_cache(layer)
    layer.get_aiter_sparse_pa_kv_cache = lambda: cls.get_aiter_sparse_pa_kv_cache(layer)
    return layer


def views_of_a_copy(layer, dtype, h, layout):
    """msa-iree's views of a copy of the layer's cache buffer (K and V sharing it, as vLLM's)."""
    from msa_iree.layout import _views

    storage = layer.kv_cache if layout == "interleaved" else layer.kv_cache.transpose(0, 1)
    flat = storage.contiguous().view(-1).clone().view(dtype)
    return _views(flat.view(-1, h * 2048), layer.kv_cache.shape[0], h, layout)


def topk_rows(g, positions, topk=16):
    rows = []
    for p in positions:
        if p < 0:  # a padding row
            rows.append([-1] * topk)
            continue
        own = p // 128
        older = torch.randperm(own, generator=g).tolist()[:topk - 1]
        row = [own] + older + [-1] * (topk - 1 - len(older))
        rows.append([row[i] for i in torch.randperm(topk, generator=g).tolist()])
    return rows


CASES = [  # (step name, kv dtype, KV heads, layout, the platform's fp8, per-token scales)
    ("decode", FNUZ, 1, "interleaved", FNUZ, False),
    ("spec-decode", FNUZ, 1, "interleaved", FNUZ, True),
    ("mixed", FNUZ, 1, "interleaved", FNUZ, False),
    ("padded", FNUZ, 1, "interleaved", FNUZ, False),
    ("decode", FN, 1, "interleaved", FN, False),
    ("mixed", BF16, 2, "planes", FNUZ, False),
    ("spec-decode", BF16, 2, "interleaved", FNUZ, False),
]


@pytest.mark.parametrize("name, kv, h, layout, platform_fp8, per_token", CASES,
                         ids=[f"{c[0]}-{str(c[1])[6:]}-h{c[2]}-{c[3]}{'-token' if c[5] else ''}" for c in CASES])
def test_the_impl_attends_as_the_reference(plugin, monkeypatch, name, kv, h, layout, platform_fp8, per_token):
    """A step through vLLM's interface: the builder's metadata in a forward context, K/V written
    through the layer's patched `_insert_aiter_sparse_pa_kv`, the attend through the impl's
    forward (vLLM's signature), against msa-iree's reference on the same cache bytes."""
    monkeypatch.setattr(common.current_platform, "fp8_dtype", lambda: platform_fp8)
    cm = dict(steps())[name]
    impl = plugin.MsaIreeImpl(16 * h, 128, SCALE, h, "auto" if kv == BF16 else "fp8", topk_blocks=16,
                              sparse_block_size=128)
    layer = vllm_layer(kv, h, layout, impl, per_token_scales=per_token)
    builder = plugin.MsaIreeMetadataBuilder(SPEC, [layer.layer_name], vllm_config(), torch.device("cpu"))
    md = builder.build(0, cm)
    n = md.num_actual_tokens
    g = torch.Generator().manual_seed(len(name) + h)
    qlens = (cm.query_start_loc[1:] - cm.query_start_loc[:-1]).tolist()
    computed = (cm.seq_lens - torch.tensor(qlens)).tolist()
    positions = [c + i for c, q in zip(computed, qlens) for i in range(q)]
    positions += [-1] * (n - len(positions))  # padding rows
    layer.topk_indices_buffer[:, :n] = torch.tensor([topk_rows(g, positions)] * h, dtype=torch.int32)
    query = torch.randn(n, 16 * h * 128, generator=g).to(BF16)  # vLLM hands the impl flat rows
    key, value = (torch.randn(n, h, 128, generator=g).to(BF16) for _ in range(2))
    output = torch.full((n + 3, 16 * h * 128), float("nan"), dtype=BF16)  # rows past the step stay untouched
    k_cache, v_cache = layer.get_aiter_sparse_pa_kv_cache()
    assert k_cache.dtype == (platform_fp8 if kv != BF16 else BF16)
    before = views_of_a_copy(layer, k_cache.dtype, h, layout)
    context = ForwardContext(no_compile_layers={}, attn_metadata={layer.layer_name: md}, slot_mapping={})
    with override_forward_context(context):
        amd_model.MiniMaxM3SparseAttention._insert_aiter_sparse_pa_kv(layer, key, value, None, md.page16_slot_mapping,
                                                                      None, k_cache, v_cache)
        assert impl.forward(layer, query, layer.kv_cache, output) is output
    scales = (layer._k_scale, layer._v_scale) if kv != BF16 else (None, None)
    ref_k, ref_v = before
    R.insert_kv(key, value, ref_k, ref_v, cm.slot_mapping.int(), *scales)
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    ref = torch.full((n, 16 * h, 128), float("nan"), dtype=BF16)
    q = query.view(n, 16 * h, 128)
    topk = layer.topk_indices_buffer[:, :n]
    if md.decode is not None:
        nd, L = md.num_decode_tokens, md.decode.decode_query_len
        R.sparse_attn_decode(q[:nd], ref_k, ref_v, topk[:, :nd], md.decode.block_table, md.decode.seq_lens, h, SCALE,
                             ref[:nd], *scales, decode_query_len=L)
    if md.prefill is not None:
        p, nd = md.prefill, md.num_decode_tokens
        R.sparse_attn_prefill(q[nd:], ref_k, ref_v, topk[:, nd:], p.block_table, p.query_req_id, p.query_abs_pos, h,
                              SCALE, ref[nd:], *scales)
    got = output[:n].view(n, 16 * h, 128)
    assert not got.isnan().any() and output[n:].isnan().all()
    assert (got.float() - ref.float()).abs().max() < TOL


def test_an_emitted_table_is_used_and_checked_for_its_stride(plugin, monkeypatch):
    """With the layer's indexer-emitted table (sparse_bt_buffer / sparse_ctx_buffer) the impl
    attends over it; over a planes cache it raises vLLM's error."""
    monkeypatch.setattr(common.current_platform, "fp8_dtype", lambda: FNUZ)
    cm = dict(steps())["decode"]
    for layout in ("interleaved", "planes"):
        impl = plugin.MsaIreeImpl(16, 128, SCALE, 1, "fp8", topk_blocks=16, sparse_block_size=128)
        layer = vllm_layer(FNUZ, 1, layout, impl)
        md = plugin.MsaIreeMetadataBuilder(SPEC, [layer.layer_name], vllm_config(), torch.device("cpu")).build(0, cm)
        n = md.num_actual_tokens
        g = torch.Generator().manual_seed(5)
        topk = torch.tensor([topk_rows(g, [299, 128, 0])], dtype=torch.int32)
        k_cache, v_cache = layer.get_aiter_sparse_pa_kv_cache()
        stride = 16 if layout == "interleaved" else 8
        bt, ctx = R.build_sparse_block_table_decode(topk, md.decode.block_table, md.decode.seq_lens, 1, stride)
        layer.sparse_bt_buffer = torch.cat([bt, torch.zeros(5, 128, dtype=torch.int32)])
        layer.sparse_ctx_buffer = torch.cat([ctx, torch.zeros(5, dtype=torch.int32)])
        layer.topk_indices_buffer[:, :n] = -1  # the table, not the top-k, is what is read
        query = torch.randn(n, 16 * 128, generator=g).to(BF16)
        output = torch.empty_like(query)
        context = ForwardContext(no_compile_layers={}, attn_metadata={layer.layer_name: md}, slot_mapping={})
        with override_forward_context(context):
            if layout == "planes":
                with pytest.raises(RuntimeError, match="the indexer emitted a page table for a block spanning 16 "
                                                       "pages, but this KV cache lays a block out over 8"):
                    impl.forward(layer, query, layer.kv_cache, output)
                continue
            impl.forward(layer, query, layer.kv_cache, output)
        ref = torch.empty(n, 16, 128, dtype=BF16)
        R.sparse_paged_attend(query.view(n, 16, 128), k_cache, v_cache, bt, ctx, 1, SCALE, ref, layer._k_scale,
                              layer._v_scale)
        assert (output.view(n, 16, 128).float() - ref.float()).abs().max() < TOL


def test_a_profiling_run_returns_the_output_untouched(plugin):
    impl = plugin.MsaIreeImpl(16, 128, SCALE, 1, "auto", topk_blocks=16, sparse_block_size=128)
    layer = vllm_layer(BF16, 1, "interleaved", impl)
    output = torch.full((4, 16 * 128), float("nan"), dtype=BF16)
    context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})  # vLLM's profiling: no dict
    context.attn_metadata = None
    with override_forward_context(context):
        assert impl.forward(layer, torch.zeros(4, 16 * 128, dtype=BF16), layer.kv_cache, output) is output
    assert output.isnan().all()


def test_the_layer_views_are_msa_irees_layouts(plugin):
    """vLLM's own page-16 views of its [blocks, 2, 128, H*128] cache (both layouts) are
    msa-iree's: the same memory, shapes and strides as msa_iree.layout's views of that buffer."""
    from msa_iree.layout import _views

    impl = plugin.MsaIreeImpl(32, 128, SCALE, 2, "fp8", topk_blocks=16, sparse_block_size=128)
    for layout in ("interleaved", "planes"):
        layer = vllm_layer(FNUZ, 2, layout, impl)
        k_cache, v_cache = layer.get_aiter_sparse_pa_kv_cache()
        storage = layer.kv_cache if layout == "interleaved" else layer.kv_cache.transpose(0, 1)
        flat = storage.contiguous().view(-1).view(k_cache.dtype)
        assert flat.data_ptr() == layer.kv_cache.data_ptr()  # no copy: the storage itself
        k, v = _views(flat.view(-1, 2 * 2048), 12, 2, layout)
        for ours, theirs in ((k, k_cache), (v, v_cache)):
            assert (ours.shape, ours.stride(), ours.data_ptr()) == (theirs.shape, theirs.stride(), theirs.data_ptr())


def test_a_cache_layout_the_page_16_views_cannot_address_is_refused(plugin):
    """A cache stored neither as K/V planes nor block-interleaved (tokens outermost) is refused by
    vLLM's own view code, before the impl reads it."""
    impl = plugin.MsaIreeImpl(16, 128, SCALE, 1, "auto", topk_blocks=16, sparse_block_size=128)
    layer = vllm_layer(BF16, 1, "interleaved", impl)
    layer.kv_cache = torch.zeros(12, 128, 2, 128, dtype=BF16).transpose(1, 2)  # [blocks, 2, 128, C], token-major
    with pytest.raises(RuntimeError, match="needs each K/V head slot stored as whole 16-token pages"):
        layer.get_aiter_sparse_pa_kv_cache()


def test_a_block_size_other_than_128_is_refused(plugin):
    with pytest.raises(ValueError, match="requires block_size == 128, got 64"):
        plugin.MsaIreeMetadataBuilder(types.SimpleNamespace(block_size=64), ["layer.0"], vllm_config(),
                                      torch.device("cpu"))


# ---- the indexer ----

def indexer_vllm_config(cp=False, kv_heads=4, index_heads=4, cache_dtype="fp8"):
    """What msa-iree's indexer selection and builders read of vLLM's config (TP4 in the tests)."""
    sparse = {"sparse_num_index_heads": index_heads}
    text = types.SimpleNamespace(num_key_value_heads=kv_heads, sparse_attention_config=sparse)
    config = vllm_config()
    config.model_config.hf_text_config = text
    config.model_config.hf_config = types.SimpleNamespace(text_config=text)
    config.attention_config = types.SimpleNamespace(minimax_m3_indexer_cp=cp)
    config.cache_config = types.SimpleNamespace(cache_dtype=cache_dtype)
    config.compilation_config = types.SimpleNamespace(static_forward_context={})
    return config


@pytest.fixture
def tp4(monkeypatch):
    import vllm.distributed
    from vllm.models.minimax_m3.common import indexer as vindexer

    for module in (vllm.distributed, vindexer):
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: 4)


def select_indexer(**kw):
    args = dict(topk_blocks=16, sparse_block_size=128, index_head_dim=128, indexer_kv_dtype="bf16", score_type="max")
    args.update(kw)
    return amd_model.select_msa_indexer_impl_cls(**args)


def test_the_plugin_selects_its_indexer_where_it_serves_the_layer(plugin, tp4):
    """The ROCm model's (and its MTP layer's) table-emitting indexer selector answers msa-iree's
    impl where msa-iree serves the layer's attention and indexer, and the page-16 gate then lets
    the model hand it the table buffers; elsewhere vLLM's own answer (none without AITER)."""
    from vllm.config import set_current_vllm_config
    from vllm.models.minimax_m3.amd import mtp as amd_mtp

    from msa_iree.vllm import indexer

    with set_current_vllm_config(indexer_vllm_config()):
        assert select_indexer() is indexer.MsaIreeIndexerImpl
        assert amd_mtp.select_msa_indexer_impl_cls is amd_model.select_msa_indexer_impl_cls
        assert amd_model.minimax_m3_use_aiter_sparse_pa(1, emits_sparse_block_table=True) is True
        assert amd_mtp.minimax_m3_use_aiter_sparse_pa(1, emits_sparse_block_table=True) is True
        assert indexer.MsaIreeIndexerImpl.indexer_backend_cls.get_builder_cls() is indexer.MsaIreeIndexerMetadataBuilder
        for kw in (dict(score_type="mean"), dict(topk_blocks=8), dict(indexer_kv_dtype="mxfp4")):
            assert select_indexer(**kw) is None, kw
            assert not amd_model.minimax_m3_use_aiter_sparse_pa(1, emits_sparse_block_table=True)
    for config in (indexer_vllm_config(cp=True), indexer_vllm_config(index_heads=8),
                   indexer_vllm_config(cache_dtype="fp8_e5m2")):
        with set_current_vllm_config(config):
            assert select_indexer() is None


def make_indexer(plugin, topk_rows=256, tables_rows=256, indexer_kv_dtype="bf16"):
    from msa_iree.vllm import indexer

    topk = torch.full((1, topk_rows, 16), -7, dtype=torch.int32)
    impl = indexer.MsaIreeIndexerImpl(num_kv_heads=1, scale=1.0, topk_blocks=16, sparse_block_size=128,
                                      num_index_heads=1, index_head_dim=128, prefix="model.layers.3.self_attn.attn",
                                      init_blocks=0, local_blocks=1, indexer_kv_dtype=indexer_kv_dtype,
                                      topk_indices_buffer=topk)
    # what vLLM's MSA indexer wrapper assigns after constructing the impl
    impl.sparse_bt_buffer = torch.full((tables_rows, 128), -7, dtype=torch.int32)
    impl.sparse_ctx_buffer = torch.full((tables_rows,), -7, dtype=torch.int32)
    return impl


@pytest.mark.parametrize("name, indexer_kv_dtype", [("decode", "bf16"), ("spec-decode", "bf16"), ("mixed", "bf16"),
                                                    ("mixed", "fp8")])
def test_the_indexer_selects_and_emits_the_attends_table_as_the_reference(plugin, tp4, name, indexer_kv_dtype):
    """A step through vLLM's interface: the index group's and the attention group's metadata (their
    own block tables) from the plugin's builders in a forward context, the indexer's forward as
    vLLM's MSA indexer wrapper calls it: the shared top-k buffer and the layer's table buffers
    hold reference.index_topk's top-k and the attend's table for it, rows past the step untouched.
    The step's index keys go in first through the layer's index-key write (msa-iree's insert at the
    index group's own slots). An fp8 index cache gets its index queries in e4m3fn, as vLLM's
    model writes them."""
    from vllm.config import set_current_vllm_config

    from msa_iree.vllm import indexer

    cm = dict(steps())[name]
    index_bt = torch.tensor([[10, 3, 6], [11, 8, 2], [0, 9, 4]], dtype=torch.int32)[:cm.num_reqs]
    qlens = (cm.query_start_loc[1:] - cm.query_start_loc[:-1]).tolist()
    computed = (cm.seq_lens - torch.tensor(qlens)).tolist()
    req = torch.tensor([r for r, q in enumerate(qlens) for _ in range(q)], dtype=torch.int32)
    pos = torch.tensor([c + i for c, q in zip(computed, qlens) for i in range(q)], dtype=torch.int32)
    index_slots = (index_bt[req.long(), pos.long() // 128] * 128 + pos % 128).tolist()  # the index group's own
    icm = common_metadata(index_bt.tolist(), cm.seq_lens.tolist(), qlens, index_slots)
    config = indexer_vllm_config()
    with set_current_vllm_config(config):
        impl = make_indexer(plugin, indexer_kv_dtype=indexer_kv_dtype)
        index_md = indexer.MsaIreeIndexerMetadataBuilder(SPEC, [impl.index_cache.prefix], config,
                                                         torch.device("cpu")).build(0, icm)
    attend_md = plugin.MsaIreeMetadataBuilder(SPEC, ["model.layers.3.self_attn.attn"], vllm_config(),
                                              torch.device("cpu")).build(0, cm)
    g = torch.Generator().manual_seed(len(name))
    dtype = {"bf16": BF16, "fp8": FN}[indexer_kv_dtype]
    assert impl.index_cache.dtype == dtype  # (vLLM's index cache)
    impl.index_cache.kv_cache = torch.randn(12, 128, 128, generator=g).to(dtype)
    ref_cache = impl.index_cache.kv_cache.clone()
    n = index_md.num_actual_tokens
    index_query = (2 * torch.randn(n, 128, generator=g)).to(dtype)
    index_k = torch.randn(n, 128, generator=g).to(BF16)  # the model's bf16
    context = ForwardContext(no_compile_layers={}, slot_mapping={},
                             attn_metadata={"model.layers.3.self_attn.attn": attend_md,
                                            impl.index_cache.prefix: index_md})
    wrapper = types.SimpleNamespace(impl=impl, index_cache=impl.index_cache)  # vLLM's MSA indexer's surface
    with override_forward_context(context):
        plugin.insert_index_key(wrapper, index_k, torch.tensor(index_slots))
        decode_topk, prefill_topk = impl(index_query, decode_page16_block_table=None, prefill_page16_block_table=None)
    R.insert_index_cache(index_k, ref_cache, torch.tensor(index_slots, dtype=torch.int32))
    assert torch.equal(impl.index_cache.kv_cache.view(torch.uint8), ref_cache.view(torch.uint8))
    want = R.index_topk(index_query.view(n, 1, 128), impl.index_cache.kv_cache, index_bt, req, pos,
                        init_blocks=0, local_blocks=1)
    nd = index_md.num_decode_tokens
    got = impl.topk_indices_buffer
    assert torch.equal(got[:, :n], want) and got[:, n:].eq(-7).all()
    assert (decode_topk is None) == (nd == 0) and (prefill_topk is None) == (nd == n)
    if decode_topk is not None:
        assert decode_topk.data_ptr() == got.data_ptr() and torch.equal(decode_topk, want[:, :nd])
    if prefill_topk is not None:
        assert torch.equal(prefill_topk, want[:, nd:])
    want_bt, want_ctx = R.build_sparse_block_table_prefill(want, cm.block_table_tensor, req, pos, 16)
    assert torch.equal(impl.sparse_bt_buffer[:n], want_bt) and torch.equal(impl.sparse_ctx_buffer[:n], want_ctx)
    assert impl.sparse_bt_buffer[n:].eq(-7).all() and impl.sparse_ctx_buffer[n:].eq(-7).all()
    # the attention layer's forward gets these buffers' first rows: the indexer's table for this
    # step, which it takes without its check (a host sync)
    assert attend_md.msa._emitted_table_unchanged(impl.sparse_bt_buffer[:n], impl.sparse_ctx_buffer[:n], n)


def test_the_indexer_refuses_what_it_does_not_serve(plugin, tp4):
    from vllm.config import set_current_vllm_config

    from msa_iree.vllm import indexer

    base = dict(num_kv_heads=1, scale=1.0, topk_blocks=16, sparse_block_size=128, num_index_heads=1, index_head_dim=128,
                init_blocks=0, local_blocks=1, indexer_kv_dtype="bf16")
    for i, (kw, match) in enumerate([(dict(score_type="mean"), "score_type='mean'"),
                                     (dict(num_index_heads=2), "2 index heads but 1 KV heads a rank")]):
        with set_current_vllm_config(indexer_vllm_config()):
            with pytest.raises(ValueError, match=f"MiniMax-M3 msa-iree indexer: {match}"):
                indexer.MsaIreeIndexerImpl(**{**base, **kw, "prefix": f"model.layers.{i}.self_attn.attn"})
    with set_current_vllm_config(indexer_vllm_config()):
        impl = indexer.MsaIreeIndexerImpl(**base, prefix="model.layers.9.self_attn.attn")
        with pytest.raises(ValueError, match="expected no indexer context parallelism"):
            impl.init_cp()
