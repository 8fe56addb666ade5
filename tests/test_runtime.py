"""The runtime on the host CPU: a multi-step serving simulation against the reference, and every
bad input of the interface."""
import json

import pytest
import torch

from msa_iree import reference as R
from msa_iree import testing
from msa_iree.layout import allocate_kv_cache
from msa_iree.runtime import BuildMismatchError, KernelLibrary, MetadataBuilder, SparseAttention, insert_kv

BF16, F16, FNUZ, FN = torch.bfloat16, torch.float16, torch.float8_e4m3fnuz, torch.float8_e4m3fn


class Server:
    """Requests over a shared paged cache; each step inserts K/V, draws top-k, attends, checks."""

    def __init__(self, kernels, kv_dtype, q_dtype, layout, num_kv_heads, scale_mode, seed):
        self.g = torch.Generator().manual_seed(seed)
        self.h, self.hq, self.kv_dtype, self.q_dtype = num_kv_heads, 16, kv_dtype, q_dtype
        self.num_blocks = 24
        self.k_cache, self.v_cache = allocate_kv_cache(self.num_blocks, num_kv_heads, kv_dtype, layout, fill=0)
        self.free = torch.randperm(self.num_blocks, generator=self.g).tolist()
        self.tables: dict[str, list[int]] = {}
        self.k_scale = self.v_scale = None
        if kv_dtype in (FNUZ, FN):
            if scale_mode == "tensor":
                self.k_scale, self.v_scale = torch.tensor([0.05]), torch.tensor([0.08])
            else:
                cap = self.num_blocks * 128
                self.k_scale = 0.03 + 0.05 * torch.rand(num_kv_heads, cap, generator=self.g)
                self.v_scale = 0.03 + 0.05 * torch.rand(num_kv_heads, cap, generator=self.g)
        self.attn = SparseAttention(self.hq, num_kv_heads, 128, 128 ** -0.5, kv_dtype, kernels=kernels,
                                    query_dtype=q_dtype)
        self.kernels = kernels
        self.builder = MetadataBuilder(max_num_seqs=8, max_model_len=4096, num_cache_blocks=self.num_blocks,
                                       kernels=kernels)
        self.lens: dict[str, int] = {}

    def slots_for(self, name, start, n):
        table = self.tables.setdefault(name, [])
        while len(table) * 128 < start + n:
            table.append(self.free.pop())
        return [table[p // 128] * 128 + p % 128 for p in range(start, start + n)]

    def step(self, decodes, prefills, L):
        """decodes: names (None = padded request); prefills: (name, chunk). Returns max errors."""
        names, qlens, computed, slots = [], [], [], []
        for name in decodes:
            if name is None:
                names.append(None); qlens.append(L); computed.append(0); slots += [-1] * L
                continue
            start = self.lens[name]
            names.append(name); qlens.append(L); computed.append(start); slots += self.slots_for(name, start, L)
            self.lens[name] = start + L
        for name, chunk in prefills:
            start = self.lens.get(name, 0)
            names.append(name); qlens.append(chunk); computed.append(start); slots += self.slots_for(name, start, chunk)
            self.lens[name] = start + chunk
        n = sum(qlens)
        cols = max(len(self.tables.get(x, [])) for x in names if x) if any(names) else 1
        bt = torch.tensor([(self.tables.get(x, []) + [0] * cols)[:cols] if x else [0] * cols for x in names],
                          dtype=torch.int32)
        seq_lens = torch.tensor([self.lens[x] if x else 0 for x in names], dtype=torch.int32)
        qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
        slot_mapping = torch.tensor(slots, dtype=torch.int32)
        md = self.builder.build(bt, seq_lens, qsl, torch.tensor(computed, dtype=torch.int32), L, len(decodes),
                                slot_mapping=slot_mapping)

        key = torch.randn(n, self.h, 128, generator=self.g).to(self.q_dtype)
        value = torch.randn(n, self.h, 128, generator=self.g).to(self.q_dtype)
        insert_kv(self.kernels, key, value, self.k_cache, self.v_cache, md, self.k_scale, self.v_scale)
        want_k, want_v = self.k_cache.clone(), self.v_cache.clone()

        # positions per token, then a top-k that always holds the query's own block
        pos = torch.cat([torch.arange(c, c + q) if x else torch.full((q,), -1) for x, c, q in zip(names, computed, qlens)])
        pos = torch.where(torch.tensor([x is not None for x, q in zip(names, qlens) for _ in range(q)]),
                          pos, -1)
        topk = torch.tensor([[testing.random_topk_row(self.g, int(p), 16) for p in pos] for _ in range(self.h)],
                            dtype=torch.int32)
        q = torch.randn(n, self.hq, 128, generator=self.g).to(self.q_dtype)
        out = torch.full_like(q, float("nan"))
        self.attn.forward(q, self.k_cache, self.v_cache, out, topk, md, self.k_scale, self.v_scale)

        ref = torch.full_like(q, float("nan"))
        nd = md.num_decode_tokens
        if nd:
            R.sparse_attn_decode(q[:nd], self.k_cache, self.v_cache, topk[:, :nd], md.decode.block_table,
                                 md.decode.seq_lens, self.h, 128 ** -0.5, ref[:nd], self.k_scale, self.v_scale,
                                 decode_query_len=L)
        if n > nd:
            p = md.prefill
            R.sparse_attn_prefill(q[nd:], self.k_cache, self.v_cache, topk[:, nd:], p.block_table, p.query_req_id,
                                  p.query_abs_pos, self.h, 128 ** -0.5, ref[nd:], self.k_scale, self.v_scale)
        assert torch.equal(self.k_cache.view(torch.uint8), want_k.view(torch.uint8))  # attend never writes KV
        assert torch.equal(self.v_cache.view(torch.uint8), want_v.view(torch.uint8))
        assert not out.isnan().any(), "padded rows must be finite and every row written"
        active = pos >= 0
        err = (out[active].float() - ref[active].float()).abs()
        assert err.max() < 1.7e-2 and err.mean() < 2.5e-4, (err.max(), err.mean())
        assert out[~active].eq(0).all()
        return md


@pytest.mark.parametrize("kv, qd, layout, hkv, smode", [
    (BF16, BF16, "interleaved", 1, "tensor"),
    (F16, F16, "planes", 2, "tensor"),
    (FNUZ, BF16, "interleaved", 1, "tensor"),
    (FN, BF16, "planes", 1, "token"),
])
def test_serving_simulation(host_kernels, kv, qd, layout, hkv, smode):
    s = Server(host_kernels, kv, qd, layout, hkv, smode, seed=hash((str(kv), layout)) % 1000)
    addr = s.builder.page16_block_table_buffer.data_ptr()
    s.step([], [("a", 200), ("b", 130)], 1)                       # two chunked prefills
    s.step(["b", None], [("a", 100), ("c", 129)], 1)              # decode, a padded request, prefill with prefix
    s.step(["a", "b", "c", None], [], 4)                          # speculative decode L = 4
    md = s.step(["a", "c"], [("d", 255), ("b", 3)], 4)            # spec decode + prefills
    assert s.builder.page16_block_table_buffer.data_ptr() == addr
    assert torch.equal(md.decode.page16_block_table, md.decode.block_table * 2)


# ---- bad inputs ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_setup(host_kernels):
    c = testing.decode_case([300, 129], kv_dtype=FNUZ, seed=21)
    attn = SparseAttention(16, 1, 128, c.scale, FNUZ, kernels=host_kernels)
    builder = MetadataBuilder(4, 4096, num_cache_blocks=c.k_cache.shape[0] // 16, kernels=host_kernels)
    md = builder.build(c.block_table.clamp(min=0), c.seq_lens, torch.arange(3, dtype=torch.int32),
                       c.seq_lens - 1, 1, 2)
    return c, attn, md, builder


def call(c, attn, md, **over):
    args = dict(query=c.q, k_cache=c.k_cache, v_cache=c.v_cache, output=torch.empty_like(c.q), topk=c.topk,
                metadata=md, k_scale=c.k_scale, v_scale=c.v_scale)
    args.update(over)
    return attn.forward(**args)


def test_forward_matches_reference_with_emitted_table(fp8_setup):
    c, attn, md, _ = fp8_setup
    bt, ctx = R.build_sparse_block_table_decode(c.topk, c.block_table, c.seq_lens, 1, 16)
    a = call(c, attn, md)
    b = call(c, attn, md, sparse_block_table=bt, sparse_context_lens=ctx)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("over, err, match", [
    (lambda c: dict(query=c.q.float()), ValueError, "q: expected"),
    (lambda c: dict(query=c.q.half()), ValueError, "query: expected torch.bfloat16"),
    (lambda c: dict(query=c.q[:, :8]), ValueError, r"q: expected shape \[\*, 16, 128\]"),
    (lambda c: dict(k_cache=c.k_cache.view(torch.float8_e4m3fn), v_cache=c.v_cache.view(torch.float8_e4m3fn)),
     ValueError, "k_cache: expected torch.float8_e4m3fnuz, got torch.float8_e4m3fn.*silent garbage"),
    (lambda c: dict(k_cache=c.k_cache.view(torch.uint8), v_cache=c.v_cache.view(torch.uint8)), ValueError, "k_cache"),
    (lambda c: dict(v_cache=c.v_cache[:-2]), ValueError, "v_cache.shape"),
    (lambda c: dict(k_cache=c.k_cache.to("meta"), v_cache=c.v_cache.to("meta")), ValueError, "device"),
    (lambda c: dict(output=torch.empty(2, 16, 128, dtype=torch.float16)), ValueError, "out: expected"),
    (lambda c: dict(topk=c.topk.long()), ValueError, "topk"),
    (lambda c: dict(k_scale=torch.ones(1, 5)), ValueError, "k_scale"),
    (lambda c: dict(k_scale=torch.ones(1, dtype=torch.float16)), ValueError, "k_scale"),
    (lambda c: dict(sparse_block_table=torch.zeros(2, 128, dtype=torch.int32)), ValueError, "provided together"),
    (lambda c: dict(sparse_block_table=torch.full((2, 128), 10 ** 6, dtype=torch.int32),
                    sparse_context_lens=torch.full((2,), 2048, dtype=torch.int32)), IndexError, "out of range"),
])
def test_bad_forward_inputs(fp8_setup, over, err, match):
    c, attn, md, _ = fp8_setup
    with pytest.raises(err, match=match):
        call(c, attn, md, **over(c))


def test_emitted_table_on_planes_cache_is_a_stride_error(host_kernels):
    c = testing.decode_case([129], layout="planes", seed=22)
    attn = SparseAttention(16, 1, 128, c.scale, BF16, kernels=host_kernels)
    md = MetadataBuilder(2, 1024, kernels=host_kernels).build(c.block_table, c.seq_lens,
                                                              torch.arange(2, dtype=torch.int32), c.seq_lens - 1, 1, 1)
    bt, ctx = R.build_sparse_block_table_decode(c.topk, c.block_table, c.seq_lens, 1, 8)
    with pytest.raises(RuntimeError, match="block spanning 16 pages, but this KV cache lays a block out over 8"):
        call(c, attn, md, sparse_block_table=bt, sparse_context_lens=ctx, k_scale=None, v_scale=None)


def test_builder_errors(fp8_setup):
    c, _, _, builder = fp8_setup
    bt = c.block_table.clamp(min=0)
    with pytest.raises(ValueError, match=r"exceeds the page-16 rebase buffer \(4, 32\)"):
        builder.build(torch.zeros(5, 2, dtype=torch.int32), torch.ones(5, dtype=torch.int32),
                      torch.arange(6, dtype=torch.int32), torch.zeros(5, dtype=torch.int32), 1, 5)
    with pytest.raises(IndexError, match="block_table: expected ids in"):
        builder.build(bt + 1000, c.seq_lens, torch.arange(3, dtype=torch.int32), c.seq_lens - 1, 1, 2)
    with pytest.raises(ValueError, match="decode query lengths: expected 4 or 0"):
        builder.build(bt, c.seq_lens, torch.tensor([0, 4, 5], dtype=torch.int32), c.seq_lens - 1, 4, 2)
    with pytest.raises(ValueError, match="decode_query_len: expected > 0"):
        builder.build(bt, c.seq_lens, torch.arange(3, dtype=torch.int32), c.seq_lens - 1, 0, 2)


def test_insert_rejects_slots_beyond_cache(host_kernels):
    kc, vc = allocate_kv_cache(2, 1, BF16, "interleaved", fill=0)
    key = torch.zeros(1, 1, 128, dtype=BF16)
    with pytest.raises(IndexError, match="slot_mapping"):
        insert_kv(host_kernels, key, key, kc, vc, torch.tensor([256], dtype=torch.int32))


def test_mismatched_builds_are_refused(tmp_path):
    from msa_iree import compile as C
    from msa_iree import kernels as K
    from msa_iree.config import MsaConfig

    spec = K.RebaseSlotsSpec(MsaConfig())
    C.build(MsaConfig(), ["host"], tmp_path, specs=[spec], log=lambda m: None)
    lib = KernelLibrary("host", tmp_path, compile_missing=False)
    lib.function(spec)  # loads
    with pytest.raises(BuildMismatchError, match="expected target 'cuda'"):
        KernelLibrary("cuda", tmp_path)
    m = json.loads((tmp_path / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**m, "iree_compiler_version": "3.9.0"}))
    with pytest.raises(BuildMismatchError, match="IREE 3.9.0"):
        KernelLibrary("host", tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    (tmp_path / m["kernels"][spec.name]["file"]).write_bytes(b"garbage")
    with pytest.raises(BuildMismatchError, match="sha256"):
        KernelLibrary("host", tmp_path).function(spec)
    with pytest.raises(BuildMismatchError, match="expected kernel"):
        KernelLibrary("host", tmp_path, compile_missing=False).function(K.RebaseBlockTableSpec(MsaConfig()))
