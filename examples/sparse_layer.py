"""One MiniMax-M3 sparse layer, the lightning indexer included, over two serving steps at TP4 (16
query heads, 1 KV head and 1 index head a rank), through the compiled host kernels, checked
against the torch reference.

Each step is planned once (a MetadataBuilder per KV-cache group: the attention's and the index
cache's, each with its own block table and slots), then run as each of the model's sparse layers
would: the step's index keys into the index cache, the indexer's top-16 blocks a token together
with the attend's page table for them, and the attend over that table, the step's K/V handed to
it. Request A comes with 2,048 tokens in the caches from earlier steps: step 1 prefills A's next
200 tokens (blocks 17 and 18: each of those tokens chooses 16 of its 17 or 18 blocks) and B's
first 300, step 2 decodes one token of each. Run it with `python examples/sparse_layer.py`.
"""
import torch

from msa_iree import layout, reference
from msa_iree.runtime import Indexer, KernelLibrary, MetadataBuilder, SparseAttention

BLOCK = 128        # tokens of a vLLM block (= a sparse block)
SCALE = 128 ** -0.5
KV_DTYPE = torch.float8_e4m3fnuz  # gfx942's fp8 (NVIDIA: torch.float8_e4m3fn)
NUM_BLOCKS = 40    # blocks of each cache (the two requests hold 36)

# The host kernels, compiled on first use into the content cache (~30 s once). With a build from
# `msa-iree compile --target host --kv-dtype fp8_e4m3fnuz --index-cache-dtype bf16 --out build/host`:
# KernelLibrary("host", "build/host").
lib = KernelLibrary("host", compile_missing=True)

# The layer's caches: K/V in fp8 with one scale per tensor, the index keys in bf16 (vLLM's
# indexer_kv_dtype "bf16": what MI300X serves), each in its own pool of blocks.
k_cache, v_cache = layout.allocate_kv_cache(NUM_BLOCKS, num_kv_heads=1, dtype=KV_DTYPE, fill=0)
k_scale, v_scale = torch.tensor([0.05]), torch.tensor([0.04])
index_cache = torch.zeros(NUM_BLOCKS, BLOCK, 128, dtype=torch.bfloat16)  # [blocks, 128 tokens, 128]

attn = SparseAttention(num_heads=16, num_kv_heads=1, head_size=128, scale=SCALE, kv_cache_dtype=KV_DTYPE,
                       kernels=lib)
# MiniMax-M3's sparse_init_block 0, sparse_local_block 1: a token's own block always among its 16
indexer = Indexer(num_index_heads=1, index_cache_dtype=torch.bfloat16, init_blocks=0, local_blocks=1, kernels=lib)
kv_builder, index_builder = (MetadataBuilder(max_num_seqs=8, max_model_len=4096, num_cache_blocks=NUM_BLOCKS,
                                             kernels=lib) for _ in range(2))

# Each group's block table: cache block ids by the request's logical block (-1: none).
generator = torch.Generator().manual_seed(0)
kv_table = torch.randperm(NUM_BLOCKS, generator=generator)[:2 * 18].int().view(2, 18)
index_table = torch.randperm(NUM_BLOCKS, generator=generator)[:2 * 18].int().view(2, 18)


def slots(table, request, positions):
    """vLLM's slot mapping: the cache slot of each token, block id * 128 + offset."""
    return (table[request, positions // BLOCK].long() * BLOCK + positions % BLOCK).int()


# Request A's first 2,048 tokens, which earlier steps wrote (here the reference's inserts stand in
# for them); the reference then computes from its own copies of the caches.
prefix = torch.arange(2048)
prefix_k, prefix_v = (torch.randn(2048, 1, 128, generator=generator).to(torch.bfloat16) for _ in range(2))
reference.insert_kv(prefix_k, prefix_v, k_cache, v_cache, slots(kv_table, 0, prefix), k_scale, v_scale)
reference.insert_index_cache(torch.randn(2048, 128, generator=generator).to(torch.bfloat16), index_cache,
                             slots(index_table, 0, prefix))
ref_k, ref_v, ref_index = k_cache.clone(), v_cache.clone(), index_cache.clone()


def step(num_computed, num_new, num_decodes):
    """Plan and run one step of the layer: num_new[r] tokens of request r after num_computed[r],
    the first num_decodes requests decoding one token. Returns the attend's largest error."""
    computed = torch.tensor(num_computed, dtype=torch.int32)
    new = torch.tensor(num_new, dtype=torch.int32)
    seq_lens = computed + new
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32), new.cumsum(0).int()])
    request = torch.repeat_interleave(torch.arange(len(num_new)), new)            # every token's request
    position = torch.cat([torch.arange(c, c + n) for c, n in zip(num_computed, num_new)])
    kv_slots, index_slots = slots(kv_table, request, position), slots(index_table, request, position)

    # plan: once per step, for every layer
    kv_md = kv_builder.build(kv_table, seq_lens, query_start_loc, computed, decode_query_len=1,
                             num_decodes=num_decodes, slot_mapping=kv_slots)
    index_md = index_builder.build(index_table, seq_lens, query_start_loc, computed, decode_query_len=1,
                                   num_decodes=num_decodes, slot_mapping=index_slots)

    # run: what each sparse layer does with its own caches and the step's projections
    n = int(query_start_loc[-1])
    index_k = torch.randn(n, 128, generator=generator).to(torch.bfloat16)         # [tokens, 128]
    index_q = torch.randn(n, 1, 128, generator=generator).to(torch.bfloat16)      # [tokens, index heads, 128]
    key, value = (torch.randn(n, 1, 128, generator=generator).to(torch.bfloat16) for _ in range(2))
    query = torch.randn(n, 16, 128, generator=generator).to(torch.bfloat16)       # [tokens, q heads, 128]
    indexer.insert(index_k, index_cache, index_md)
    topk, page_table, page_counts = indexer.topk_with_table(index_q, index_cache, index_md, kv_md)
    output = torch.empty_like(query)
    attn.forward(query, k_cache, v_cache, output, topk, kv_md, k_scale, v_scale,
                 sparse_block_table=page_table, sparse_context_lens=page_counts, key=key, value=value)

    # the reference, from its own caches
    reference.insert_index_cache(index_k, ref_index, index_slots)
    reference.insert_kv(key, value, ref_k, ref_v, kv_slots, k_scale, v_scale)
    ref_topk = reference.index_topk(index_q, ref_index, index_table, request.int(), position.int())
    assert torch.equal(topk, ref_topk), "the indexer's top-k differs from the reference's"
    ref = torch.empty_like(query)
    reference.sparse_attn_prefill(query, ref_k, ref_v, ref_topk, kv_table, request.int(), position.int(), 1, SCALE,
                                  ref, k_scale, v_scale)
    return float((output.float() - ref.float()).abs().max())


err_prefill = step(num_computed=[2048, 0], num_new=[200, 300], num_decodes=0)  # a chunk of A, B's first 300
err_decode = step(num_computed=[2248, 300], num_new=[1, 1], num_decodes=2)    # one more token each

ok = err_prefill < 1.7e-2 and err_decode < 1.7e-2
print(f"top-k equal to the reference's; attend max abs error prefill {err_prefill:.2e}, decode {err_decode:.2e} "
      f"(bound 1.7e-2): {'OK' if ok else 'MISMATCH'}")
raise SystemExit(0 if ok else 1)
