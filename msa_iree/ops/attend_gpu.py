"""The hand-written GPU attend: what its three families (ops/fma.py, ops/mma.py, ops/mfma.py)
share. One template, `templates/sparse_attend.mlir.j2`, renders every variant; a family adds its
parts of @split (`templates/<family>_split.j2`) and reads its row of the tuning table.

Same operation as the portable `sparse_attn_decode` / `sparse_attn_prefill` (the sparse table
build fused into the attend), another module interface: k/v pages arrive flat, [pages * H, 2048]
storage elements, and the output tensor and a workspace come last as the results' storage. GPU
targets only (llvm-cpu cannot lower gpu.thread_id). @split: a workgroup per (row, split), online
softmax over the split's blocks, partials into the workspace; @merge combines them. With the
tuning row's fused_merge (the matrix families) there is no @merge dispatch: a row's last @split
workgroup to finish merges the row, counted in the workspace's arrival counters.
"""
from __future__ import annotations

import dataclasses

from .spec import FP8_FORMAT, MLIR_ELEMENT, TemplateSpec, render_template
from .tuning import ARRIVAL_COUNTERS, COUNTER_WORDS, PREFILL_TUNING, TUNING, AttendTuning


@dataclasses.dataclass(frozen=True)
class GpuAttendSpec(TemplateSpec):
    """One variant of the GPU attend; `tuning` defaults to the family's row of ops/tuning.py (a
    prefill attend's: its PREFILL_TUNING row where the family has one)."""

    tuning: AttendTuning | None = None
    # a page-table variant's rows each read their own pages (a decode step of one token a
    # sequence, which the caller knows and the table does not show): kv_read_once; the module is
    # the same, so the name is too
    read_once: bool = False
    # an attend that writes the step's new K/V into the cache itself before it reads (the KV
    # insert fused in: a layer's step in one launch); the matrix families' top-k attends only
    insert_kv: bool = False

    template = "sparse_attend.mlir.j2"
    family = ""        # "fma", "mma" or "mfma": the template's parts and the tuning row
    prefill = False    # rows from query_req_id / query_abs_pos (chunked prefill), else seq_lens and L
    paged = False      # rows from a given page table (sparse_bt / sparse_ctx: the indexer's), decode or prefill
    native_fp8 = None  # the fp8 format this family's target converts in hardware (hw_fp8)
    emulate_mfma = False
    # `main` takes the output tensor and a workspace (workspace_floats) last and writes into them
    # (iree.abi.output): the call allocates nothing (an allocation costs ~100 us of host time a call)
    output_storage = True
    FUSED_FAMILIES = ("mma", "mfma")  # whose @split can write the output (fused_merge)
    GROUP_SIZES = (8, 16)  # heads per KV head: softmax groups are subgroup clusters of 256 / G <= 32 lanes

    def __post_init__(self):
        if self.tuning is None:
            rows = PREFILL_TUNING if self.prefill else TUNING
            object.__setattr__(self, "tuning", rows.get(self.family, TUNING[self.family]))
        if self.cfg.group_size not in self.GROUP_SIZES:
            raise ValueError(f"num_heads / num_kv_heads: expected one of {self.GROUP_SIZES} for the GPU attend, "
                             f"got {self.cfg.group_size}")
        if self.cfg.topk != 16:
            raise ValueError(f"topk: expected 16 for the GPU attend, got {self.cfg.topk}")
        if self.tuning.fused_merge and self.family not in self.FUSED_FAMILIES:
            raise ValueError(f"tuning.fused_merge: expected only for the {'/'.join(self.FUSED_FAMILIES)} families "
                             f"(their @split writes the output itself), got it for {self.family}")
        if (self.tuning.prefetch_next or self.tuning.prefetch_next_fp8) and self.family != "mma":
            raise ValueError(f"tuning.prefetch_next: expected only for the mma family (CUDA's prefetch.global.L2), "
                             f"got it for {self.family}")
        if self.insert_kv and (self.paged or self.family not in self.FUSED_FAMILIES):
            raise ValueError(f"insert_kv: expected only for a top-k attend of the {'/'.join(self.FUSED_FAMILIES)} "
                             f"families, got it for {self.kernel}")
        if self.read_once and not self.paged:
            raise ValueError(f"read_once: expected only for a page-table attend (its rows' reads are not known "
                             f"from its operands), got it for {self.kernel}")

    @classmethod
    def supports(cls, cfg) -> bool:
        """True when `cfg` can be built by this kernel (what __post_init__ would otherwise refuse)."""
        return cfg.group_size in cls.GROUP_SIZES and cfg.topk == 16

    @classmethod
    def unsupported_reason(cls, cfg) -> str | None:
        """Why `cfg` cannot be built by this kernel, in one line; None where it can."""
        try:
            cls(cfg, 16)
        except ValueError as e:
            return str(e)
        return None

    # ---- the knobs in effect (the template's parameters, the name's suffix) ----

    def knobs(self) -> dict:
        """The tuning knobs in effect for this config: the family's row, resolved (a knob that
        does not apply to this dtype or family is off)."""
        t, fp8 = self.tuning, self.cfg.is_fp8
        hw_fp8 = t.hw_fp8 and self.cfg.kv_dtype == self.native_fp8
        async_kv = t.async_kv_fp8 and fp8
        # a given page table has no block-table row to stage (nor q loads to overlap with it)
        bt_preload = 0 if self.paged else t.bt_preload
        # with fused_merge there is no @merge dispatch for its grid knobs to shape
        merge_rows_splits, merge_row_parts = (0, 1) if t.fused_merge else (t.merge_rows_splits, t.merge_row_parts)
        return {"SPLITS": self.tuning.split_rule(fp8), "MERGE_ROWS_SPLITS": merge_rows_splits,
                "MRP": merge_row_parts, "BT_PRELOAD": bt_preload,
                "MIN_CTAS": t.min_ctas(fp8),
                "WAVES_PER_EU": None if self.emulate_mfma else t.waves_per_eu, "HW_FP8": hw_fp8,
                "ASYNC_KV": async_kv, "EARLY_V": t.early_v and not fp8,
                "Q_FIRST": self.q_first_applies(t.q_first and bt_preload > 0), "FUSED_MERGE": t.fused_merge,
                # decode rows of several tokens a request only: a prefill's rows did not gain (its
                # neighbours' picks overlap less), and a given table's entries are page groups
                "SORT_BLOCKS": t.sort_blocks and not self.prefill and not self.paged and self.cfg.decode_query_len > 1,
                # decode rows of one token a request only: where rows share pages the L2 is the bound
                # (a given table's read_once is not in the module's name: its module stays one)
                "PREFETCH_NEXT": t.prefetch_sides(fp8) if self.kv_read_once and not self.paged else "",
                # an inserting prefill attend's insert workgroups (templates/sparse_attend.mlir.j2, step_roles)
                "INS_TOKENS": t.insert_tokens if self.insert_kv and self.prefill else 0}

    def q_first_applies(self, wanted: bool) -> bool:
        return wanted

    @property
    def tag(self) -> str:
        """The knobs in effect, spelled out for the variant name (every knob that is on)."""
        k = self.knobs()
        parts = ["-".join(f"r{rows}s{splits}" for rows, splits in k["SPLITS"])]
        if k["MERGE_ROWS_SPLITS"]:
            parts.append(f"mr{k['MERGE_ROWS_SPLITS']}x{k['MRP']}")
        if k["BT_PRELOAD"]:
            parts.append(f"bt{k['BT_PRELOAD']}")
        if k["MIN_CTAS"]:
            parts.append(f"cta{k['MIN_CTAS']}")
        if k["WAVES_PER_EU"]:
            parts.append(f"wpe{k['WAVES_PER_EU']}")
        parts += [flag for key, flag in (("HW_FP8", "hwcvt"), ("ASYNC_KV", "akv"), ("EARLY_V", "ev"),
                                         ("Q_FIRST", "qf"), ("FUSED_MERGE", "fm"), ("SORT_BLOCKS", "sb")) if k[key]]
        if k["PREFETCH_NEXT"]:
            parts.append(f"pf{k['PREFETCH_NEXT']}")
        return ".".join(parts)

    @property
    def variant(self) -> str:
        # a decode's L is in its name; prefill and page-table rows carry their own positions
        base = super().variant if self.prefill or self.paged else f"{super().variant}.L{self.cfg.decode_query_len}"
        insert = f".ins{self.knobs()['INS_TOKENS'] or ''}" if self.insert_kv else ""
        return f"{base}.{self.tag}{insert}"

    @property
    def written_operands(self) -> tuple:
        """The operands `main` writes (the output and the workspace, the last two; with insert_kv the
        k/v page views, operands 1 and 2), all of them given to it, so that msa_iree.runtime.
        cuda_launch can launch it on torch's stream."""
        return (-2, -1, 1, 2) if self.insert_kv else (-2, -1)

    def describe(self) -> dict:
        knobs = {k.lower(): list(map(list, v)) if k == "SPLITS" else v for k, v in self.knobs().items()}
        return {**super().describe(), "family": self.family, "prefill": self.prefill, "paged": self.paged,
                "insert_kv": self.insert_kv, "knobs": knobs}

    def render(self) -> str:
        c = self.cfg
        return render_template(self.template, G=c.group_size, H=c.num_kv_heads, L=c.decode_query_len,
                               QT=MLIR_ELEMENT[c.query_dtype], KT=MLIR_ELEMENT[c.kv_dtype],
                               FP8=FP8_FORMAT.get(c.kv_dtype), STRIDE=self.stride, PREFILL=self.prefill, PAGED=self.paged,
                               MMA=self.family == "mma", MFMA=self.family == "mfma", EMULATE=self.emulate_mfma,
                               INSERT=self.insert_kv, ARRIVALS=ARRIVAL_COUNTERS, COUNTERS=COUNTER_WORDS, **self.knobs())

    # ---- what the runtime needs to know ----

    def splits(self, rows: int) -> int:
        """Workgroups per row the attend launches for `rows` rows."""
        return self.tuning.splits_for(rows, self.cfg.is_fp8)

    def workspace_floats(self, num_tokens: int) -> int:
        """f32 elements of the workspace `main` takes after the output, enough for any call of up
        to num_tokens tokens: COUNTER_WORDS i32 counters (zero before the first call; every
        call leaves them zero), then the split partials o and (m, l), 130 floats per (row, split,
        head) (the MFMA family stores o in f16 and (m, l, o's scale): 67 floats of that room)."""
        rows = num_tokens * self.cfg.num_kv_heads
        return COUNTER_WORDS + self.tuning.max_partials(rows, self.cfg.is_fp8) * self.cfg.group_size * 130

    def for_graph(self) -> "GpuAttendSpec":
        """The variant a CUDA / HIP graph captures: a decode or page-table attend with fused_merge
        as the same attend in two dispatches (@split, @merge). A graph replays its launches
        without host time, and there the separate @merge is faster at 16 and 8 splits (the row's
        last workgroup merging every head reads its 8-16 partials alone; benchmarks/PERF.md);
        eagerly the one launch fewer is worth more. Itself otherwise (a prefill is not captured:
        its rows take one split). An insert_kv attend's graph variant inserts too (a kernel fewer
        a layer in the graph)."""
        if self.prefill or not self.tuning.fused_merge:
            return self
        return dataclasses.replace(self, tuning=dataclasses.replace(self.tuning, fused_merge=False))

    def with_insert(self) -> "GpuAttendSpec | None":
        """This attend with the KV insert fused in (insert_kv: `main` also takes the step's new
        key, value [T, H, 128] and slots [T] after v_scale, and writes them into the k/v page
        views before it reads them), where it has one (a top-k attend of the matrix families: a
        decode's workgroups write what their rows read; a prefill's (a step with prefills, every
        row) has insert workgroups that the attend's wait for); else None."""
        if self.paged or self.family not in self.FUSED_FAMILIES:
            return None
        return dataclasses.replace(self, insert_kv=True)

    @property
    def kv_read_once(self) -> bool:
        """Whether each K/V page it reads is read by one row only: a decode with one query token a
        sequence (a row reads its own top-k blocks; rows share pages only through a shared prefix).
        Its loads may then be marked L2 evict-first (runtime.cuda_launch.with_l2_evict_first);
        where rows share pages (several tokens a sequence, prefill) the hint costs re-reads. A given
        page table's rows may be either: its spec's read_once says."""
        if self.paged:
            return self.read_once
        return not self.prefill and self.cfg.decode_query_len == 1


class MatrixAttendSpec(GpuAttendSpec):
    """A GPU attend whose products run on matrix instructions: both operands share one type, so the
    cache holds the query's dtype or fp8 (decoded exactly into f16, the query converted to f16)."""

    def __post_init__(self):
        super().__post_init__()
        if not self.cfg.is_fp8 and self.cfg.kv_dtype != self.cfg.query_dtype:
            raise ValueError(f"kv_dtype: expected fp8 or the query dtype {self.cfg.query_dtype} for the "
                             f"{self.family} attend (both operands share one type), got {self.cfg.kv_dtype}")

    @classmethod
    def supports(cls, cfg) -> bool:
        return super().supports(cfg) and (cfg.is_fp8 or cfg.kv_dtype == cfg.query_dtype)
