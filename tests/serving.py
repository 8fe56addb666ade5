"""A small serving loop shared by the host and GPU runtime tests: requests over a shared paged
cache; each step inserts K/V, draws top-k, builds metadata, attends, and checks the output
against the torch reference (computed on the CPU). K/V go in through the layer's
SparseAttention.insert_kv (runtime.insert_kv's checks; on a GPU its bound launch), or with
insert_in_forward through forward(key=, value=) (on a GPU: the attend's own launch),
the cache then checked byte for byte against reference.insert_kv's."""
import torch

from msa_iree import reference as R
from msa_iree import testing
from msa_iree.layout import allocate_kv_cache
from msa_iree.runtime import MetadataBuilder, SparseAttention
from tolerances import assert_attend_close

FP8 = (torch.float8_e4m3fnuz, torch.float8_e4m3fn)


class Server:
    """Requests over a shared paged cache; each step inserts K/V, draws top-k, attends, checks."""

    def __init__(self, kernels, kv_dtype, q_dtype, layout, num_kv_heads, scale_mode, seed, device="cpu",
                 num_heads=16, gpu_matrix="auto", insert_in_forward=False, wide_table=False):
        self.g = torch.Generator().manual_seed(seed)
        self.layout, self.insert_in_forward = layout, insert_in_forward
        # wide_table: the block table as wide as max_model_len, as vLLM hands it (columns past a
        # request's blocks hold ids that are not its own: stale ones, -1 and past the cache),
        # with the step's longest seq_len given
        self.wide_table = wide_table
        self.dev = torch.device(device)
        self.h, self.hq, self.kv_dtype, self.q_dtype = num_kv_heads, num_heads, kv_dtype, q_dtype
        self.num_blocks = 24
        self.k_cache, self.v_cache = allocate_kv_cache(self.num_blocks, num_kv_heads, kv_dtype, layout,
                                                      device=self.dev, fill=0)
        self.free = torch.randperm(self.num_blocks, generator=self.g).tolist()
        self.tables: dict[str, list[int]] = {}
        self.k_scale = self.v_scale = None
        if kv_dtype in FP8:
            if scale_mode == "tensor":
                self.k_scale, self.v_scale = torch.tensor([0.05], device=self.dev), torch.tensor([0.08], device=self.dev)
            else:
                cap = self.num_blocks * 128
                self.k_scale = (0.03 + 0.05 * torch.rand(num_kv_heads, cap, generator=self.g)).to(self.dev)
                self.v_scale = (0.03 + 0.05 * torch.rand(num_kv_heads, cap, generator=self.g)).to(self.dev)
        self.attn = SparseAttention(self.hq, num_kv_heads, 128, 128 ** -0.5, kv_dtype, kernels=kernels,
                                    query_dtype=q_dtype, gpu_matrix=gpu_matrix)
        self.kernels = kernels
        self.builder = MetadataBuilder(max_num_seqs=8, max_model_len=4096, num_cache_blocks=self.num_blocks,
                                       kernels=kernels, device=self.dev)
        self.lens: dict[str, int] = {}

    def slots_for(self, name, start, n):
        table = self.tables.setdefault(name, [])
        while len(table) * 128 < start + n:
            table.append(self.free.pop())
        return [table[p // 128] * 128 + p % 128 for p in range(start, start + n)]

    def step(self, decodes, prefills, L):
        """decodes: names (None = a padding request, vLLM's CUDA-graph padding: query length 0,
        seq_len 0, its L tokens counted in num_actual_tokens; only at the end of a decode-only
        batch); prefills: (name, chunk). Returns the step's metadata."""
        if None in decodes:
            assert not prefills and decodes[decodes.index(None):] == [None] * (len(decodes) - decodes.index(None))
        names, qlens, computed, slots = [], [], [], []
        for name in decodes:
            if name is None:
                names.append(None); qlens.append(0); computed.append(0); slots += [-1] * L
                continue
            start = self.lens[name]
            names.append(name); qlens.append(L); computed.append(start); slots += self.slots_for(name, start, L)
            self.lens[name] = start + L
        for name, chunk in prefills:
            start = self.lens.get(name, 0)
            names.append(name); qlens.append(chunk); computed.append(start); slots += self.slots_for(name, start, chunk)
            self.lens[name] = start + chunk
        n = len(slots)  # num_actual_tokens: padding requests' L tokens included
        cols = max(len(self.tables.get(x, [])) for x in names if x) if any(names) else 1
        tail = [0] * cols
        if self.wide_table:
            cols, tail = 4096 // 128, [self.num_blocks - 1, -1, 10 ** 6] * (4096 // 128)
        bt = torch.tensor([(self.tables.get(x, []) + tail)[:cols] if x else tail[:cols] for x in names],
                          dtype=torch.int32)
        seq_lens = torch.tensor([self.lens[x] if x else 0 for x in names], dtype=torch.int32)
        hint = {"max_seq_len": int(seq_lens.max()) + 1} if self.wide_table else {}
        qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
        slot_mapping = torch.tensor(slots, dtype=torch.int32)
        computed_t = torch.tensor(computed, dtype=torch.int32)
        bt, seq_lens, qsl, computed_t, slot_mapping = (x.to(self.dev) for x in (bt, seq_lens, qsl, computed_t, slot_mapping))
        md = self.builder.build(bt, seq_lens, qsl, computed_t, L, len(decodes), slot_mapping=slot_mapping,
                                num_actual_tokens=n, **hint)

        key = torch.randn(n, self.h, 128, generator=self.g).to(self.q_dtype).to(self.dev)
        value = torch.randn(n, self.h, 128, generator=self.g).to(self.q_dtype).to(self.dev)
        cpu = lambda x: None if x is None else x.cpu()
        if self.insert_in_forward:  # the cache forward must leave: the reference's insert into a copy
            want_k, want_v = allocate_kv_cache(self.num_blocks, self.h, self.kv_dtype, self.layout, fill=0)
            want_k.copy_(self.k_cache.cpu()), want_v.copy_(self.v_cache.cpu())
            R.insert_kv(key.cpu(), value.cpu(), want_k, want_v, slot_mapping.cpu()[:n], cpu(self.k_scale),
                        cpu(self.v_scale))
            new_kv = {"key": key, "value": value}
        else:
            self.attn.insert_kv(key, value, self.k_cache, self.v_cache, md, self.k_scale, self.v_scale)
            want_k, want_v = self.k_cache.clone(), self.v_cache.clone()
            new_kv = {}

        # positions per token, then a top-k that always holds the query's own block
        pos = torch.cat([torch.arange(c, c + q) if x else torch.full((L,), -1) for x, c, q in zip(names, computed, qlens)])
        topk = torch.tensor([[testing.random_topk_row(self.g, int(p), 16) for p in pos] for _ in range(self.h)],
                            dtype=torch.int32)
        q = torch.randn(n, self.hq, 128, generator=self.g).to(self.q_dtype)
        out = torch.full_like(q, float("nan"), device=self.dev)
        self.attn.forward(q.to(self.dev), self.k_cache, self.v_cache, out, topk.to(self.dev), md, self.k_scale,
                          self.v_scale, **new_kv)
        out = out.cpu()

        # the reference, on the CPU, from copies of everything the attend saw
        kc, vc, ks, vs = cpu(self.k_cache), cpu(self.v_cache), cpu(self.k_scale), cpu(self.v_scale)
        ref = torch.full_like(q, float("nan"))
        nd = md.num_decode_tokens
        if nd:
            R.sparse_attn_decode(q[:nd], kc, vc, topk[:, :nd], cpu(md.decode.block_table), cpu(md.decode.seq_lens),
                                 self.h, 128 ** -0.5, ref[:nd], ks, vs, decode_query_len=L)
        if n > nd:
            p = md.prefill
            R.sparse_attn_prefill(q[nd:], kc, vc, topk[:, nd:], cpu(p.block_table), cpu(p.query_req_id),
                                  cpu(p.query_abs_pos), self.h, 128 ** -0.5, ref[nd:], ks, vs)
        # the attend writes no KV (or, given key/value, exactly the insert's)
        assert torch.equal(self.k_cache.cpu().view(torch.uint8), want_k.cpu().view(torch.uint8))
        assert torch.equal(self.v_cache.cpu().view(torch.uint8), want_v.cpu().view(torch.uint8))
        assert not out.isnan().any(), "padded rows must be finite and every row written"
        active = pos >= 0
        assert_attend_close(out[active], ref[active], "serving step")
        assert out[~active].eq(0).all()
        return md


