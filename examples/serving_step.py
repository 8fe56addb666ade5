"""Two serving steps of MiniMax-M3's sparse attention at TP4 (16 query heads, 1 KV head a rank)
over an fp8 KV cache, through the compiled host kernels, checked against the torch reference.

Step 1 prefills two requests (their K/V written into the cache, then the attend); step 2 decodes
one new token for each, its K/V handed to the attend itself (on a GPU the decode attend writes
them inside its own launch). Run it with `python examples/serving_step.py`.
"""
import torch

from msa_iree import layout, reference
from msa_iree.runtime import KernelLibrary, MetadataBuilder, SparseAttention

BLOCK = 128        # tokens of a vLLM block (= a sparse block)
TOPK = 16          # blocks a query attends to
SCALE = 128 ** -0.5
KV_DTYPE = torch.float8_e4m3fnuz  # gfx942's fp8 (NVIDIA: torch.float8_e4m3fn)

# The host kernels, compiled on first use into the content cache (~1 minute once). With a build
# from `msa-iree compile --target host --out build/host`: KernelLibrary("host", "build/host").
lib = KernelLibrary("host", compile_missing=True)

# One layer's cache: 16 blocks of 128 tokens, K and V interleaved (vLLM's LBHNC), fp8 with one
# scale per tensor (vLLM's layer._k_scale / _v_scale).
k_cache, v_cache = layout.allocate_kv_cache(num_blocks=16, num_kv_heads=1, dtype=KV_DTYPE, fill=0)
k_scale, v_scale = torch.tensor([0.05]), torch.tensor([0.04])

attn = SparseAttention(num_heads=16, num_kv_heads=1, head_size=128, scale=SCALE, kv_cache_dtype=KV_DTYPE,
                       kernels=lib)
builder = MetadataBuilder(max_num_seqs=8, max_model_len=4096, num_cache_blocks=16, kernels=lib)

# Request A owns blocks 5, 9, 2 of the cache (its tokens 0..127, 128..255, 256..383), request B
# blocks 7, 1: the block table holds cache block ids by the request's logical block (-1: none).
block_table = torch.tensor([[5, 9, 2], [7, 1, -1]], dtype=torch.int32)


def slots(request, positions):
    """vLLM's slot mapping: the cache slot of each token, block id * 128 + offset."""
    return block_table[request, positions // BLOCK].long() * BLOCK + positions % BLOCK


def causal_topk(positions):
    """A stand-in for the indexer: each token picks its own block and every earlier one (up to 16),
    as logical block ids of its request, -1 padded. Shape [kv_heads, tokens, 16] int32."""
    rows = [list(range(int(p) // BLOCK, -1, -1))[:TOPK] for p in positions]
    return torch.tensor([[r + [-1] * (TOPK - len(r)) for r in rows]], dtype=torch.int32)


def attend_and_check(query, topk, md, seq_lens, positions_per_request, decode, **new_kv):
    output = torch.empty_like(query)
    attn.forward(query, k_cache, v_cache, output, topk, md, k_scale, v_scale, **new_kv)
    ref = torch.empty_like(query)
    if decode:
        reference.sparse_attn_decode(query, k_cache, v_cache, topk, block_table, seq_lens, 1, SCALE, ref,
                                     k_scale, v_scale)
    else:
        req = torch.cat([torch.full((len(p),), r) for r, p in enumerate(positions_per_request)]).int()
        pos = torch.cat(positions_per_request).int()
        reference.sparse_attn_prefill(query, k_cache, v_cache, topk, block_table, req, pos, 1, SCALE, ref,
                                      k_scale, v_scale)
    return float((output.float() - ref.float()).abs().max())


torch.manual_seed(0)

# ---- step 1: prefill A (300 tokens) and B (130 tokens) ----
positions = [torch.arange(300), torch.arange(130)]
seq_lens = torch.tensor([300, 130], dtype=torch.int32)
query_start_loc = torch.tensor([0, 300, 430], dtype=torch.int32)
num_computed_tokens = torch.tensor([0, 0], dtype=torch.int32)  # nothing cached before this step
slot_mapping = torch.cat([slots(0, positions[0]), slots(1, positions[1])]).int()
md = builder.build(block_table, seq_lens, query_start_loc, num_computed_tokens, decode_query_len=1,
                   num_decodes=0, slot_mapping=slot_mapping)
key, value = (torch.randn(430, 1, 128).to(torch.bfloat16) for _ in range(2))  # [tokens, kv_heads, 128]
attn.insert_kv(key, value, k_cache, v_cache, md, k_scale, v_scale)             # quantized by the scales
query = torch.randn(430, 16, 128).to(torch.bfloat16)                           # [tokens, q_heads, 128]
err_prefill = attend_and_check(query, causal_topk(torch.cat(positions)), md, seq_lens, positions, decode=False)

# ---- step 2: decode one token each (A at position 300, B at 130) ----
positions = [torch.tensor([300]), torch.tensor([130])]
seq_lens = torch.tensor([301, 131], dtype=torch.int32)  # the new token included
query_start_loc = torch.tensor([0, 1, 2], dtype=torch.int32)
num_computed_tokens = torch.tensor([300, 130], dtype=torch.int32)
slot_mapping = torch.cat([slots(0, positions[0]), slots(1, positions[1])]).int()
md = builder.build(block_table, seq_lens, query_start_loc, num_computed_tokens, decode_query_len=1,
                   num_decodes=2, slot_mapping=slot_mapping)
key, value = (torch.randn(2, 1, 128).to(torch.bfloat16) for _ in range(2))
query = torch.randn(2, 16, 128).to(torch.bfloat16)
# the new tokens' K/V go in with the attend (the same as insert_kv first, then forward)
err_decode = attend_and_check(query, causal_topk(torch.cat(positions)), md, seq_lens, positions, decode=True,
                              key=key, value=value)

ok = err_prefill < 1.7e-2 and err_decode < 1.7e-2
print(f"prefill max abs error {err_prefill:.2e}, decode {err_decode:.2e} (bound 1.7e-2): {'OK' if ok else 'MISMATCH'}")
raise SystemExit(0 if ok else 1)
