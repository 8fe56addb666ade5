"""The indexer's block scores and top-16 as one hand-written GPU-level MLIR text
(templates/index_topk_gpu.mlir.j2): the same operation as the portable `index_topk`
(ops/indexer.py, reference.index_topk), the scores never written to memory.

Two dispatches: @score (a workgroup per (split, token), decode launches' tokens along the grid's
x: the split's block scores in LDS, then each head's top-16 of them into the workspace) and
@merge (a workgroup per (token, head): the splits' top-16s merged into the row's). GPU targets
only (llvm-cpu cannot lower gpu.thread_id); the host runs the portable kernel. `dot="fma"`
compiles for CUDA and gfx942 (run on CUDA only: no AMD GPU here), `dot="mma"` (tensor cores;
which one CUDA serves: tuning.INDEXER_DOT) for CUDA only,
`dot="mfma"` (matrix cores, bf16 or e4m3fn keys and queries) for gfx942 only: compiled and inspected, NEVER RUN on
an AMD GPU; its numerics are proven on CUDA by its emulated twin (`emulate_mfma`, tests only).

Shapes: T tokens, H index heads, C index block-table columns (at most 8,192: 1M tokens).
"""
from __future__ import annotations

import dataclasses

from .indexer import check_index_cache_dtype, index_q_dtype
from .spec import FP8_FORMAT, MLIR_ELEMENT, TemplateSpec, render_template
from .tuning import IndexerTuning, indexer_tuning

MAX_COLUMNS = 128 * 64  # blocks per split (LDS of 128 scores) x splits (@merge: 8 teams of 8)
# a tiled launch's tiles: this many consecutive tokens of one request (fewer at its end), each
# tile's first token in a table the step's metadata builder makes (MsaMetadata.query_tiles)
QUERY_TILE = 64


@dataclasses.dataclass(frozen=True)
class IndexTopkGpuSpec(TemplateSpec):
    """Operands as the portable IndexTopkSpec's (index_q [T, H, 128], fp8_queries: as bytes; the
    index cache as [blocks, 16384] storage elements, index_block_table [R, C], req_id / abs_pos
    [T]; tiled: then tiles [tiles] int32, each tile's first token), then the output topk
    [H, >= T, 16] int32 (rows < T written) and a workspace (workspace_floats) as the results'
    storage: the call allocates nothing. cfg as IndexTopkSpec's (num_kv_heads: index heads)."""

    init_blocks: int = 0
    local_blocks: int = 1
    tuning: IndexerTuning | None = None   # a row of knobs in place of the launch's (None: see `tuning_row`)
    # also the attend's page table for the picks (@merge writes it): main then takes the attention
    # group's block table after abs_pos, and sparse_bt [>= T, H, 128], sparse_ctx [>= T, H] int32
    # between topk and the workspace
    emit_table: bool = False
    # tokens a workgroup of @score scores together, sharing every key load: untiled, a decode
    # step's L tokens of one request (the rows come in groups of `rows` consecutive tokens of a
    # request); tiled, `rows` tokens of a query tile (any step, prefills included)
    rows: int = 1
    # the rows in tiles of QUERY_TILE tokens of a request: a table of the tiles' first tokens
    # (tiles [tiles] int32, MsaMetadata.query_tiles) follows abs_pos, QUERY_TILE / rows
    # workgroups a tile
    tiled: bool = False
    # the index queries in e4m3fn (i8 bytes; an e4m3fn index cache only), each converted exactly
    # (to bf16 for "mma", f32 for "fma") as the workgroup reads them: vLLM's model writes its
    # index queries in its fp8 index cache's dtype
    fp8_queries: bool = False
    # @score's dot products: "fma" (lane-wise products, shuffle sums over a position's lanes; CUDA
    # and gfx942) or "mma" (CUDA tensor cores: a warp's 16 positions x 128 dims against the rows'
    # and heads' queries as one m16n8k16 bf16 chain, fp8 keys converted exactly to bf16 first, as
    # vLLM's Triton indexer does for bf16 queries (for e4m3fn ones it takes an fp8 dot); sm_89+
    # for fp8, whose e4m3 -> f16 conversion is the hardware's)
    # or "mfma" (gfx942 matrix cores, MFMA_OPERANDS: a wave's 16 positions x 128 dims against up
    # to 4 groups of 16 (row, head) columns as v_mfma_f32_16x16x16_bf16 / _16x16x32_fp8_fp8 chains)
    dot: str = "fma"
    # TEST ONLY (dot="mfma"): the gfx942 text for CUDA with every MFMA computed by the 64 threads of
    # the emulated wave through LDS and its xor-32 shuffle through LDS, so that an NVIDIA GPU runs
    # and checks the MFMA kernel's tile mapping, masks and reductions (slow: two barriers an MFMA)
    emulate_mfma: bool = False

    kernel = "index_topk_gpu"
    template = "index_topk_gpu.mlir.j2"
    targets = ("cuda", "gfx942")
    output_storage = True
    INDEX_HEADS = (1, 2, 4)      # a team of the 8 selects each head's top-16
    # the targets each dot compiles for ("mfma" with emulate_mfma: cuda only)
    DOTS = {"fma": ("cuda", "gfx942"), "mma": ("cuda",), "mfma": ("gfx942",)}
    # the most (token, head) columns a tiled workgroup scores: lane-wise, 8 (a register each);
    # on tensor cores, sets of 32 (4 groups of an m16n8k16's 8 columns sharing each key fragment),
    # each of a block's sets its own team's
    # on matrix cores, up to 4 groups of the MFMA's 16 columns sharing each key fragment
    TILE_ROW_HEADS = {"fma": 8, "mma": 64, "mfma": 64}
    # (index cache, index queries) dtypes dot="mfma" takes: bf16 x bf16 on v_mfma_f32_16x16x16_bf16,
    # e4m3fn x e4m3fn (bytes remapped to e4m3fnuz) on v_mfma_f32_16x16x32_fp8_fp8
    MFMA_OPERANDS = (("bf16", "bf16"), ("fp8_e4m3fn", "fp8_e4m3fn"))

    def __post_init__(self):
        check_index_cache_dtype(self.cfg, self.fp8_queries)
        if self.cfg.num_kv_heads not in self.INDEX_HEADS:
            raise ValueError(f"num_kv_heads: expected index heads per rank in {self.INDEX_HEADS} for the GPU "
                             f"indexer, got {self.cfg.num_kv_heads}")
        if self.cfg.topk != 16:
            raise ValueError(f"topk: expected 16 for the GPU indexer, got {self.cfg.topk}")
        if self.init_blocks < 0 or self.local_blocks < 0:
            raise ValueError(f"init_blocks, local_blocks: expected >= 0, got {self.init_blocks}, {self.local_blocks}")
        if self.dot not in self.DOTS:
            raise ValueError(f"dot: expected one of {sorted(self.DOTS)}, got {self.dot!r}")
        if self.dot == "mma" and self.cfg.query_dtype != "bf16" and not self.fp8_queries:
            raise ValueError(f"query_dtype: expected bf16 index queries for dot='mma' (a bf16 tensor-core dot), "
                             f"got {self.cfg.query_dtype}")
        operands = (self.cfg.kv_dtype, index_q_dtype(self.cfg, self.fp8_queries))
        if self.dot == "mfma" and operands not in self.MFMA_OPERANDS:
            raise ValueError(f"kv_dtype, query_dtype: expected a bf16 index cache with bf16 index queries or an "
                             f"fp8_e4m3fn one with fp8_e4m3fn queries (fp8_queries) for dot='mfma' (the matrix "
                             f"cores' bf16 and fp8 dots), got {operands[0]}, {operands[1]}")
        if self.emulate_mfma and self.dot != "mfma":
            raise ValueError(f"emulate_mfma: expected dot='mfma' (the twin of the MFMA kernel), got dot={self.dot!r}")
        if self.tiled:
            most = self.TILE_ROW_HEADS[self.dot]
            if QUERY_TILE % self.rows or self.rows * self.cfg.num_kv_heads > most:
                raise ValueError(f"rows: expected a divisor of the {QUERY_TILE}-token query tile with rows x index "
                                 f"heads <= {most} for tiled=True and dot={self.dot!r}, got {self.rows} with "
                                 f"{self.cfg.num_kv_heads} index heads")
        elif not 1 <= self.rows <= 4 or self.rows * self.cfg.num_kv_heads > 8:
            raise ValueError(f"rows: expected 1..4 tokens a workgroup with rows x index heads <= 8 (a team of the 8 "
                             f"selects each), got {self.rows} with {self.cfg.num_kv_heads} index heads")

    @property
    def tuning_row(self) -> IndexerTuning:
        """The knobs in effect: `tuning` where given, else the launch's row (tuning.indexer_tuning:
        by dot and tiled), derived on access, so that dataclasses.replace(spec, dot=...) takes the
        new dot's row."""
        return self.tuning or indexer_tuning(self.dot, self.tiled)

    @property
    def written_operands(self) -> tuple:
        """topk (with emit_table: and the table), then the workspace: a stream launch writes only those."""
        return (-4, -3, -2, -1) if self.emit_table else (-2, -1)

    @property
    def cuda_arch(self):
        # cvt.rn.f16x2.e4m3x2 (the fp8 keys' exact conversion) exists from sm_89 on
        # (and the MFMA twin's emulated fp8 operands)
        return 89 if (self.dot == "mma" or self.emulate_mfma) and self.cfg.is_fp8 else None

    def target_flags(self, target: str) -> list[str]:
        allowed = ("cuda",) if self.emulate_mfma else self.DOTS[self.dot]
        if target not in allowed:
            what = f"dot={self.dot!r}" + (" with emulate_mfma" if self.emulate_mfma else "")
            raise ValueError(f"target: {what} compiles for {' and '.join(allowed)}, got {target}")
        return super().target_flags(target)

    @classmethod
    def supports(cls, cfg) -> bool:
        return cfg.num_kv_heads in cls.INDEX_HEADS and cfg.topk == 16 and cfg.kv_dtype in ("bf16", "fp8_e4m3fn")

    @property
    def variant(self):
        c, t = self.cfg, self.tuning_row
        return (f"h{c.num_kv_heads}.{c.kv_dtype}.q{index_q_dtype(c, self.fp8_queries)}.k{c.topk}.init{self.init_blocks}."
                f"local{self.local_blocks}.b{t.min_blocks_per_split}s{t.max_splits}"
                + (f"g{t.grid_workgroups}" if t.grid_workgroups else "")
                + (f"m{t.merge_rows}" if t.merge_rows > 1 else "")
                + (f"x{t.merge_splits_per_team}" if t.merge_splits_per_team != 8 else "") + self._dot_knob
                + (".gm" if t.group_major else "")
                + (f".t{self.rows}" if self.tiled else f".r{self.rows}" if self.rows > 1 else "")
                + (".emit" if self.emit_table else ""))

    @property
    def _dot_knob(self) -> str:
        t, c = self.tuning_row, self.cfg
        if self.dot == "mma":
            return (f".mma{self.tiles}" + (f"cta{t.min_ctas_per_sm}" if t.min_ctas_per_sm else "")
                    + (".qlds" if self.queries_in_lds else "") + (".e4m3" if self.e4m3_dot else ""))
        if self.dot == "mfma":
            return (f".mfma{t.mfma_tiles}" + (f"wpe{self._waves_per_eu}" if self._waves_per_eu else "")
                    + ("emu" if self.emulate_mfma else ""))
        return f"u{t.loads_for(self.rows, c.num_kv_heads, c.is_fp8)}"

    @property
    def _waves_per_eu(self) -> int | None:
        """gfx942's waves per SIMD asked of the register allocator: the MFMA kernel's (not its twin's)."""
        return self.tuning_row.mfma_waves_per_eu if self.dot == "mfma" and not self.emulate_mfma else None

    def describe(self) -> dict:
        return {**super().describe(), "init_blocks": self.init_blocks, "local_blocks": self.local_blocks,
                "emit_table": self.emit_table, "rows": self.rows, "tiled": self.tiled, "dot": self.dot,
                "fp8_queries": self.fp8_queries, "emulate_mfma": self.emulate_mfma,
                "tuning": dataclasses.asdict(self.tuning_row)}

    def render(self) -> str:
        c, t = self.cfg, self.tuning_row
        return render_template(self.template, H=c.num_kv_heads, QT=MLIR_ELEMENT[index_q_dtype(c, self.fp8_queries)],
                               FP8Q=self.fp8_queries,
                               KT=MLIR_ELEMENT[c.kv_dtype], FP8=FP8_FORMAT.get(c.kv_dtype), AMDCVT=False,
                               INIT=self.init_blocks, LOCAL=self.local_blocks, MIN_BPS=t.min_blocks_per_split,
                               MAX_SPLITS=t.max_splits, GRID_WG=t.grid_workgroups, GROUP_MAJOR=t.group_major,
                               U=t.loads_for(self.rows, c.num_kv_heads, c.is_fp8), EMIT=self.emit_table,
                               ROWS=self.rows, TILED=self.tiled, QUERY_TILE=QUERY_TILE, DOT=self.dot,
                               TILES=self.tiles, EMULATE=self.emulate_mfma,
                               WAVES_PER_EU=self._waves_per_eu,
                               MIN_CTAS=t.min_ctas_per_sm if self.dot == "mma" else None,
                               NCS=self.column_sets, QLDS=self.queries_in_lds, E4M3DOT=self.e4m3_dot,
                               MERGE_ROWS=t.merge_rows,
                               MERGE_SPT=t.merge_splits_per_team)

    @property
    def queries_in_lds(self) -> bool:
        """A tiled tensor-core workgroup's queries over an e4m3fn cache (bf16; e4m3fn as they are
        for the e4m3 dot, else converted exactly to bf16 as they are staged) as mma B fragments in
        LDS (the tuning row's mma_queries_lds_fp8)."""
        return self.tiled and self.dot == "mma" and self.cfg.is_fp8 and self.tuning_row.mma_queries_lds_fp8

    @property
    def e4m3_dot(self) -> bool:
        """e4m3fn queries against e4m3fn keys on the tensor cores' e4m3 dot, nothing converted (the
        tuning row's mma_e4m3_dot): the dot vLLM's Triton indexer takes for these operands."""
        return self.dot == "mma" and self.fp8_queries and self.tuning_row.mma_e4m3_dot

    @property
    def tiles(self) -> int:
        """@score's tiles of 16 positions in flight a warp or wave (the tuning row's, by dot)."""
        return self.tuning_row.tiles_for(self.cfg.is_fp8, self.dot, self.queries_in_lds, self.e4m3_dot)

    @property
    def column_sets(self) -> int:
        """Teams scoring each block of @score: on tensor cores one a set of 32 (token, head) columns
        (4 groups of the m16n8k16's 8), all of them with the queries in LDS; lane-wise 1."""
        if self.dot != "mma" or self.queries_in_lds:
            return 1
        return -(-self.rows * self.cfg.num_kv_heads // 32)

    def workspace_floats(self, num_tokens: int, columns: int) -> int:
        """32-bit words of the workspace for num_tokens tokens over `columns` block-table columns:
        each split's 16 picks (key and block id) per (token, head), then each token's splits."""
        return (2 * self.cfg.num_kv_heads * self.tuning_row.splits(columns) * 16 + 1) * num_tokens
