"""How the hand-written GPU attend is tuned, as data: one row per kernel family (PREFILL_TUNING: a
family's prefill row where it departs from that).

This table is the single source of every tuning knob: the attend template receives a row as it
is (`AttendTuning.template_params`), the spec derives its workspace bound and its name from it, and
nothing else restates a rule. A family fixes its target: `fma` is built for CUDA and gfx942 alike,
`mma` for CUDA, `mfma` for gfx942 (its CUDA twin with emulated MFMAs, a test kernel, runs gfx942's
row so that it runs the same text). Why each value is what it is: benchmarks/PERF.md, the
decision record (the H200 measurements behind the CUDA rows; the gfx942 ISA behind the mfma row,
which no MI300X has measured).
"""
from __future__ import annotations

import dataclasses

# Splits of a row's 16 top-k entries over workgroups, by row count: ((at most this many rows,
# this many splits), ...), rows ascending; more rows than the last entry: 1 split. Few rows need
# more workgroups to fill the GPU; each split costs a partial (o, m, l) and @merge's work.
SPLITS = ((16, 16), (32, 8), (64, 4), (128, 2))
# fp8 rows of the MFMA attend split at most 8 ways: the partials written between its two
# dispatches stay under 10% of the K/V bytes a row reads (f32 partials at 16 splits: 25%)
SPLITS_AT_MOST_8 = ((16, 8), (32, 8), (64, 4), (128, 2))
# The attend's workspace opens with one i32 counter per row that a split rule may split (rows
# 0..ARRIVAL_COUNTERS - 1), its partials after: with fused_merge a row's workgroups count
# themselves done there and the last one merges the row (it sets the count back to 0)
ARRIVAL_COUNTERS = 128


def _fp8_or(value, fp8_value, fp8: bool):
    """A knob's value: its fp8 variant's for fp8 caches where that is set (not None)."""
    return fp8_value if fp8 and fp8_value is not None else value


@dataclasses.dataclass(frozen=True)
class AttendTuning:
    """One kernel family's knobs (the defaults are the knob's off state)."""

    splits: tuple = SPLITS                # split rule for 16-bit caches (see SPLITS)
    splits_fp8: tuple = SPLITS            # ... and for fp8 caches
    merge_rows_splits: int = 0            # @merge: a workgroup per row up to this many splits (0: per (row, head))
    merge_row_parts: int = 1              # ... at exactly merge_rows_splits splits, this many workgroups a row
    bt_preload: int = 0                   # the request's block-table row staged in LDS up to this many columns
    min_ctas_per_sm: int | None = None    # CUDA: workgroups per SM asked of ptxas (caps its registers)
    waves_per_eu: int | None = None       # gfx942: waves per SIMD asked of the register allocator
    hw_fp8: bool = False                  # the target's own fp8 format converted by the hardware
    async_kv_fp8: bool = False            # CUDA: fp8 K/V staged in LDS by cp.async one block ahead
    early_v: bool = False                 # CUDA, K/V read into registers: V requested right after QK
    q_first: bool = False                 # q requested during the page-id fetch (needs bt_preload)
    fused_merge: bool = False             # one dispatch: a row's last @split workgroup to finish merges it
    min_ctas_per_sm_fp8: int | None = None  # ... for fp8 caches (None: min_ctas_per_sm)
    sort_blocks: bool = False             # decode rows of L > 1 tokens a request visit their blocks in ascending order
    prefetch_next: str = ""               # mma, rows that read their own pages: the next entry's pages of these
                                          # sides ("k", "v", "kv") asked of the L2 as a block starts, 16-bit caches
    prefetch_next_fp8: str | None = None  # ... for fp8 caches (None: prefetch_next)

    def __post_init__(self):
        for name in ("splits", "splits_fp8"):
            rule = getattr(self, name)
            rows = [r for r, _ in rule]
            if not rule or rows != sorted(rows) or any(s < 1 or 16 % s for _, s in rule):
                raise ValueError(f"AttendTuning.{name}: expected ((rows, splits), ...) with rows ascending and "
                                 f"splits dividing 16, got {rule!r}")
        split_rows = max([r for rule in (self.splits, self.splits_fp8) for r, s in rule if s > 1], default=0)
        if split_rows > ARRIVAL_COUNTERS:
            raise ValueError(f"AttendTuning: expected rows split over workgroups only up to {ARRIVAL_COUNTERS} "
                             f"(the workspace's arrival counters), got a rule splitting {split_rows} rows")
        sides = ("", "k", "v", "kv")
        if self.prefetch_next not in sides or self.prefetch_next_fp8 not in sides + (None,):
            raise ValueError(f"AttendTuning.prefetch_next, prefetch_next_fp8: expected '', 'k', 'v' or 'kv' (the "
                             f"sides prefetched; fp8 also None), got {self.prefetch_next!r}, {self.prefetch_next_fp8!r}")
        if self.bt_preload % 256:  # the staged row is copied by the 256 threads, 256 columns a step
            raise ValueError(f"AttendTuning.bt_preload: expected a multiple of 256 block-table columns, "
                             f"got {self.bt_preload}")

    def min_ctas(self, fp8: bool) -> int | None:
        return _fp8_or(self.min_ctas_per_sm, self.min_ctas_per_sm_fp8, fp8)

    def prefetch_sides(self, fp8: bool) -> str:
        return _fp8_or(self.prefetch_next, self.prefetch_next_fp8, fp8)

    def split_rule(self, fp8: bool) -> tuple:
        return self.splits_fp8 if fp8 else self.splits

    def splits_for(self, rows: int, fp8: bool) -> int:
        """Workgroups per row the attend launches for `rows` rows (the template's rule)."""
        return next((s for limit, s in self.split_rule(fp8) if rows <= limit), 1)

    def max_partials(self, rows: int, fp8: bool) -> int:
        """The most (row, split) partials any call of up to `rows` rows writes."""
        return max([min(limit, rows) * s for limit, s in self.split_rule(fp8)] + [rows])


# the rows of the table
TUNING = {
    "fma": AttendTuning(),
    "mma": AttendTuning(
        # a workgroup per row up to 4 splits (>= 33 rows), two at exactly 4: a row's partials
        # are read by one workgroup, and at 4 splits two of them keep more of the GPU busy
        merge_rows_splits=4, merge_row_parts=2,
        # up to 1024 columns (128K tokens) the page ids wait on one global load, not two in a chain
        bt_preload=1024,
        # 2 workgroups per SM (<= 128 registers): left alone ptxas gave the 8-head kernel 184 and
        # one workgroup per SM, 1.3x slower
        min_ctas_per_sm=2,
        hw_fp8=True,          # e4m3fn: cvt.rn.f16x2.e4m3x2 (sm_89+)
        async_kv_fp8=True,    # fp8 only: bf16's staging takes 64 KiB of LDS and was slower
        early_v=True,         # V's loads in flight during the softmax
        q_first=True,         # fp8 only (mma.q_first_applies): bf16's raw q early was slower
        fused_merge=True,     # one launch, not two: a launch is ~4 us of host time a layer
        # a request's L tokens pick overlapping blocks; in one order their rows (neighbours in the
        # grid) reach a shared block at about the same time and the later ones read it from L2
        sort_blocks=True,
        # rows that read their own pages (one token a request) ask the L2 for the next block's K
        # as a block starts (bf16: its V is requested early already, and both sides were slower):
        # faster warm and in a graph of 57 layers, about the same right after an L2 flush. fp8
        # none: on an H200 both sides were 2-7% slower (an H100 gained 11-19% warm). Rows that
        # share pages keep none: they are bound by the L2, and L > 1 lost 3-26% (prefill, bound
        # the same way, unmeasured; decision record in benchmarks/PERF.md)
        prefetch_next="k", prefetch_next_fp8="",
    ),
    "mfma": AttendTuning(
        splits_fp8=SPLITS_AT_MOST_8,
        merge_rows_splits=4,
        bt_preload=256,       # 1 KiB of LDS keeps 4 workgroups (16 waves) a CU
        waves_per_eu=4,       # fp8 124 VGPRs with it, 128 without; q in registers took 155
        hw_fp8=True,          # e4m3fnuz: v_cvt_pk_f32_fp8, 4 instructions per 4 values, not ~19
        q_first=True,         # the q staging's barrier had put a memory round trip before the first K
        fused_merge=True,     # one dispatch: no launch (nor HIP graph node) for @merge
        sort_blocks=True,     # the mma row's order (its emulated twin proves the numerics)
    ),
}
# Where a family's prefill attend departs from its row above. A prefill's rows each read 16 of the
# request's blocks from L2: the fp8 rows are bound by L1/LDS traffic, not by the L2 (ncu), and
# three workgroups an SM reading K/V straight into registers beat two staging it in LDS.
PREFILL_TUNING = {
    "mma": dataclasses.replace(TUNING["mma"], async_kv_fp8=False, min_ctas_per_sm_fp8=3),
}


@dataclasses.dataclass(frozen=True)
class IndexerTuning:
    """The GPU indexer's knobs (templates/index_topk_gpu.mlir.j2). A token's candidate blocks are
    split over workgroups of min_blocks_per_split blocks (one per team of 32 lanes at 8) up to
    max_splits splits, above that ceil(candidates / max_splits) blocks each (at most 128: 8,192
    columns, 1M tokens), by the candidates of the request's rows, whatever the table's width; key_loads: 16-byte bf16 key loads in flight per lane, scoring one token's one head
    (fp8 keys: half as many; p (token, head) pairs: 1 / p as many, at least 4 bf16 / 2 fp8); max_row_heads: the most (token, head) pairs a
    workgroup scores together from one key load (a decode step's tokens of a request, as many as
    divide its L): past 4 gfx942 gives the score more than 128 VGPRs (fewer than 4 waves a SIMD)."""

    min_blocks_per_split: int = 8
    max_splits: int = 64
    # @score's grid: None, a workgroup a split (the grid holds the longest row's splits for every
    # group, and a table wider than the step's rows leaves most of them idle); else a group's
    # workgroups take its splits in turn, as few of them as keep the launch at this many
    # workgroups (all of the longest row's splits while the step's groups are fewer), so the idle
    # ones stop growing with the groups there (decision record in benchmarks/PERF.md)
    grid_workgroups: int | None = None
    # @score's groups along the grid's x, its splits along y (else the splits along x): every
    # group's first split is dispatched before any second, the working workgroups of a table
    # wider than the step's rows placed before its idle ones; a tiled launch's groups share one
    # request's keys, which its splits along x fetch from DRAM together (decision record in
    # benchmarks/PERF.md)
    group_major: bool = False
    key_loads: int = 8
    max_row_heads: int = 4
    # dot="mma" (CUDA tensor cores): tiles of 16 positions a warp has in flight, bf16 / fp8 keys
    # (more in flight was slower for bf16: decision record in benchmarks/PERF.md)
    mma_tiles: int = 1
    mma_tiles_fp8: int = 4
    # a tiled (prefill) workgroup on tensor cores: (token, head) pairs sharing each key fragment
    # (groups of the m16n8k16's 8 columns; decision record in benchmarks/PERF.md)
    tile_row_heads_mma: int = 32
    # a tiled workgroup on tensor cores over an e4m3fn index cache: the queries' mma B fragments
    # (bf16 queries, or e4m3fn ones converted exactly to bf16 as they are staged) staged once in LDS
    # and read per k-step (not held in registers), so that one team converts and scores each
    # block's keys for all of its columns (else a team holds 32 columns' fragments and two teams
    # convert each block's keys); with mma_tiles_lds tiles of 16 positions in flight a warp. bf16
    # keys keep their queries in registers (LDS was slower there: decision record in
    # benchmarks/PERF.md)
    mma_queries_lds_fp8: bool = False
    mma_tiles_lds: int = 1
    # dot="mma" with e4m3fn queries over an e4m3fn cache: the tensor cores' e4m3 x e4m3 dot
    # (m16n8k32 into f32), neither side converted, in place of both converted exactly to bf16 for
    # the bf16 dot (m16n8k16); with mma_tiles_e4m3 tiles of 16 positions in flight a warp where
    # the queries are in registers. On sm_90 ptxas lowers the e4m3 mma to an e4m3 -> f16 conversion
    # of both operands and an f16 HMMA, which still drops the bf16 path's f16 -> f32 -> bf16 steps
    # (decision record in benchmarks/PERF.md)
    mma_e4m3_dot: bool = False
    mma_tiles_e4m3: int = 2
    # dot="mfma" (gfx942 matrix cores): tiles of 16 positions a wave has in flight, and a tiled
    # workgroup's (token, head) pairs (groups of the MFMA's 16 columns sharing each key fragment)
    mfma_tiles: int = 2
    tile_row_heads_mfma: int = 32
    # dot="mfma": @score's waves per SIMD asked of gfx942's register allocator (caps its VGPRs at
    # 512 / this; None: its own choice)
    mfma_waves_per_eu: int | None = 4
    # dot="mma" (CUDA): @score's workgroups per SM asked of ptxas (caps its registers at 65536 /
    # (256 x this); None: ptxas's choice; decision record in benchmarks/PERF.md)
    min_ctas_per_sm: int | None = 2
    # @merge: at most this many (token, head) rows a workgroup (1, 2, 4 or 8), its 8 teams split
    # between them, ceil(splits / merge_splits_per_team) teams a row rounded up to a power of 2
    # (decision record in benchmarks/PERF.md)
    merge_rows: int = 1
    # @merge: the splits' picks a team selects from (8: 4 entries a lane, 16: 8)
    merge_splits_per_team: int = 8

    def __post_init__(self):
        if not (1 <= self.max_splits <= 64 and 1 <= self.min_blocks_per_split <= 128):
            raise ValueError(f"IndexerTuning: expected max_splits in [1, 64] (@merge's 8 teams of 8 splits) and "
                             f"min_blocks_per_split in [1, 128] (LDS of 128 scores), got {self.max_splits}, "
                             f"{self.min_blocks_per_split}")
        if self.grid_workgroups is not None and self.grid_workgroups < 1:
            raise ValueError(f"IndexerTuning.grid_workgroups: expected >= 1 workgroups of @score, got "
                             f"{self.grid_workgroups}")
        tiles = (self.mma_tiles, self.mma_tiles_fp8, self.mma_tiles_lds, self.mma_tiles_e4m3)
        if any(t not in (1, 2, 4, 8) for t in tiles):
            raise ValueError(f"IndexerTuning.mma_tiles, mma_tiles_fp8, mma_tiles_lds, mma_tiles_e4m3: expected 1, 2, 4 "
                             f"or 8 (a divisor of a block's 8 tiles of 16 positions), got {tiles}")
        if self.tile_row_heads_mma not in (8, 16, 32, 64):
            raise ValueError(f"IndexerTuning.tile_row_heads_mma: expected 8, 16, 32 or 64 (groups of an m16n8k16's "
                             f"8 columns, at most 4 a team, at most 2 teams a block), got {self.tile_row_heads_mma}")
        if self.mfma_tiles not in (1, 2, 4, 8) or self.tile_row_heads_mfma not in (16, 32, 64):
            raise ValueError(f"IndexerTuning.mfma_tiles, tile_row_heads_mfma: expected 1, 2, 4 or 8 tiles (a divisor "
                             f"of a block's 8) and 16, 32 or 64 columns (1-4 groups of the MFMA's 16), got "
                             f"{self.mfma_tiles}, {self.tile_row_heads_mfma}")
        if self.merge_rows not in (1, 2, 4, 8):
            raise ValueError(f"IndexerTuning.merge_rows: expected 1, 2, 4 or 8 rows a workgroup of @merge's 8 teams, "
                             f"got {self.merge_rows}")
        if self.merge_splits_per_team not in (8, 16):
            raise ValueError(f"IndexerTuning.merge_splits_per_team: expected 8 or 16 splits a team of @merge, "
                             f"got {self.merge_splits_per_team}")
        if self.min_ctas_per_sm is not None and not 1 <= self.min_ctas_per_sm <= 8:
            raise ValueError(f"IndexerTuning.min_ctas_per_sm: expected None or 1..8 workgroups of 256 threads an SM, "
                             f"got {self.min_ctas_per_sm}")
        if 32 % self.key_loads:
            raise ValueError(f"IndexerTuning.key_loads: expected a divisor of 32 (a team's loads a block, fp8), "
                             f"got {self.key_loads}")

    def loads_for(self, rows: int, heads: int, fp8: bool) -> int:
        # an fp8 load decodes into twice the registers of a bf16 one
        return max(2 if fp8 else 4, self.key_loads // (2 if fp8 else 1) // (rows * heads))

    def tiles_for(self, fp8: bool, dot: str = "mma", queries_in_lds: bool = False, e4m3_dot: bool = False) -> int:
        if dot == "mfma":
            return self.mfma_tiles
        if queries_in_lds:
            return self.mma_tiles_lds
        return self.mma_tiles_e4m3 if e4m3_dot else self.mma_tiles_fp8 if fp8 else self.mma_tiles

    def rows_for(self, decode_query_len: int, num_index_heads: int) -> int:
        """Tokens of a request scored together in a decode step of L = decode_query_len tokens a
        request: the most that divide L within max_row_heads (token, head) pairs."""
        return max(r for r in range(1, 5) if decode_query_len % r == 0 and r * num_index_heads <= self.max_row_heads
                   or r == 1)

    def tile_rows(self, num_index_heads: int, dot: str) -> int:
        """Tokens of a query tile a tiled workgroup scores together: tile_row_heads_mma (token,
        head) pairs on tensor cores, tile_row_heads_mfma on matrix cores, max_row_heads lane-wise."""
        pairs = {"mma": self.tile_row_heads_mma, "mfma": self.tile_row_heads_mfma}.get(dot, self.max_row_heads)
        return max(1, pairs // num_index_heads)

    def blocks_per_split(self, candidates: int) -> int:
        """Blocks a split scores for a group of rows with `candidates` candidate blocks (the
        template's split rule: each group by its own, not by the table's width)."""
        narrow = -(-candidates // self.min_blocks_per_split) <= self.max_splits
        return self.min_blocks_per_split if narrow else -(-candidates // self.max_splits)

    def splits(self, columns: int) -> int:
        """The splits a row of a block table of `columns` columns may take (the workspace's room
        for each row): as many as its longest row takes."""
        return max(1, min(-(-columns // self.min_blocks_per_split), self.max_splits))

    def grid_splits(self, columns: int, groups: int) -> int:
        """@score's workgroups a group of rows (the template's grid): splits(columns), or with
        grid_workgroups as few as keep the launch at that many, each taking the group's splits
        in turn."""
        if self.grid_workgroups is None:
            return self.splits(columns)
        return min(self.splits(columns), -(-self.grid_workgroups // max(groups, 1)))


INDEXER = IndexerTuning(group_major=True)
# a tiled (prefill) launch's row: splits of 16 blocks (a workgroup's entry loads, a chain of
# dependent ones, shared by twice the blocks; @merge's teams read half the splits) and, on tensor
# cores, 64 (token, head) columns, two teams on each block's bf16 keys, one on e4m3fn keys with
# bf16 queries, which it takes from LDS; two workgroups an SM as the decode row has it (ptxas
# then fits the score in 128 registers, the bf16 one with a few spilled); @merge's teams
# shared by up to 8 rows, as many as the splits leave, 16 splits a team (a prefill chunk has
# thousands of rows, each of them a short selection; a decode step's few rows keep a workgroup
# a row and 8 splits a team: decision record in benchmarks/PERF.md)
INDEXER_TILED = dataclasses.replace(INDEXER, min_blocks_per_split=16, tile_row_heads_mma=64, merge_rows=8,
                                    merge_splits_per_team=16, group_major=False, mma_queries_lds_fp8=True)
# an untiled (decode) launch on tensor cores: splits of 16 blocks, faster there than 8 at short
# contexts and the same from 32K, where the lane-wise decode is slower at 16 and keeps 8; and a
# grid of about 1,024 workgroups once the step's groups fill it, each group's workgroups taking its
# splits in turn (ptxas keeps the loop's score within its 128 registers). The lane-wise and MFMA
# rows keep a workgroup a split: the loop took gfx942's @score past 128 VGPRs (fewer than 4 waves
# a SIMD) or into scratch, and the tiled row's CUDA score into more spills (decision record in
# benchmarks/PERF.md)
# e4m3fn queries over an e4m3fn cache take the e4m3 dot, two tiles in flight (a tiled launch keeps
# the bf16 dot on its LDS-staged queries, faster there: decision record)
INDEXER_MMA = dataclasses.replace(INDEXER, min_blocks_per_split=16, grid_workgroups=1024, mma_e4m3_dot=True)


def indexer_tuning(dot: str, tiled: bool) -> IndexerTuning:
    """The row a GPU indexer launch takes: INDEXER_TILED for query tiles, else INDEXER_MMA on
    tensor cores and INDEXER otherwise."""
    return INDEXER_TILED if tiled else INDEXER_MMA if dot == "mma" else INDEXER

# how the GPU indexer's @score takes its dot products: (target, index cache dtype) -> (one token a
# workgroup, a decode step's tokens of a request or a query tile together); "mma" tensor cores
# (CUDA), "mfma" matrix cores (gfx942; bf16 or e4m3fn keys and queries of the same dtype, else
# "fma"), "fma" lane-wise products and shuffle sums. One bf16 token a workgroup reads its keys
# faster the fma way on CUDA (benchmarks/PERF.md, decision record); gfx942 follows that rule
# unmeasured (no AMD GPU), its MFMA kernel's numerics proven through its emulated twin on CUDA.
INDEXER_DOT = {("cuda", "bf16"): ("fma", "mma"), ("cuda", "fp8_e4m3fn"): ("mma", "mma"),
               ("gfx942", "bf16"): ("fma", "mfma"), ("gfx942", "fp8_e4m3fn"): ("mfma", "mfma")}
