"""Run the compiled modules on torch tensors: module loading, MetadataBuilder, SparseAttention.

Per step, `MetadataBuilder.build` does everything that needs the host (splits, positions, the
page-16 rebase into its stable buffer, range checks, the insert's slot compaction). Per layer,
`SparseAttention.forward` checks shapes and dtypes and calls one compiled module per phase.

Host CPU (`local-task`) is what the CI tests run. On `cuda`/`hip`, torch tensors that live on
the GPU are imported into IREE zero-copy through DLPack and results come back the same way
(device-resident caches are never copied per call); CPU tensors are copied through numpy.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import pathlib
import sys

import numpy as np
import torch
import torch.utils.dlpack

from . import checks
from .compile import DRIVERS, check_target, runtime_version
from .config import DTYPES, MsaConfig, dtype_name
from .kernels import (GPU_ATTEND, NATIVE_MATRIX, InsertKvGpuSpec, InsertKvSpec, KernelSpec, RebaseBlockTableSpec,
                      SparseAttnDecodeGpuSpec, SparseAttnDecodeSpec, SparseAttnPrefillGpuSpec, SparseAttnPrefillSpec,
                      SparsePagedAttendSpec, storage_dtype)
from .layout import BLOCK_SIZE, PAGES_PER_BLOCK, block_page_stride, sides_are_packed
from .reference import query_token_positions


class BuildMismatchError(RuntimeError):
    """A build directory that does not belong to this runtime (version, target, checksum)."""


# ---- torch <-> IREE --------------------------------------------------------------------------


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU numpy view of `t` that IREE accepts (bf16 as ml_dtypes, fp8 as raw bytes)."""
    import ml_dtypes

    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        return t.view(torch.uint8).numpy()
    return t.numpy()


def from_iree(arr, dtype: torch.dtype) -> torch.Tensor:
    """A host module result as a torch tensor that owns its memory: the numpy view IREE maps does
    not keep the result buffer alive once the call's DeviceArray is gone (use-after-free, seen as
    a segfault in the host insert's copy back), so it is copied out."""
    host = np.array(arr.to_host() if hasattr(arr, "to_host") else arr, copy=True, order="C")
    if dtype == torch.bfloat16:
        return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
    if dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        return torch.from_numpy(host.view(np.uint8)).view(dtype)
    return torch.from_numpy(host.view(np.dtype(str(dtype).replace("torch.", ""))))


# DLPack device type of the torch tensors each GPU driver can import (kDLCUDA, kDLROCM)
DLPACK_DEVICE_TYPE = {"cuda": 2, "hip": 10}
# IREE runtime flags per driver, set before its device is created. Streams instead of CUDA graphs
# for one-shot command buffers: 164 vs 216 us per decode forward at B=8 on an H200 (tools/PERF.md).
DRIVER_FLAGS = {"cuda": ("--cuda_use_streams=true",), "hip": ("--hip_use_streams=true",)}


def module_scale(scale, num_kv_heads, device=None):
    """The modules' scale operand, [H, S] fp32: S = 1 for one scale (or none: ones on `device`),
    else per-token slots."""
    if scale is None:
        return torch.ones(1, 1, device=device).expand(num_kv_heads, 1)
    return scale.reshape(1, 1).expand(num_kv_heads, 1) if scale.numel() == 1 else scale


def _current_raw_stream(device_index: int) -> int:
    """The CUstream of torch's current stream on a device. torch.cuda.current_stream() builds a
    Stream object per call (~5-10 us on the H200 host); the raw handle, as Triton reads it, where
    this torch has it."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device_index) if raw is not None else torch.cuda.current_stream(device_index).cuda_stream


# ---- module loading --------------------------------------------------------------------------


class KernelLibrary:
    """The compiled kernels of one target on one IREE device, loaded from a build directory.

    A kernel missing from the build is compiled on demand into the shared cache (with a message
    naming the `msa-iree compile` command that prebuilds it).

    stream_launch (cuda): kernels that write in place and whose build saved a launch plan (every
    cuda build of `msa-iree compile` does) are launched on torch's current stream by
    msa_iree.launch, queued rather than waited for, and capturable by CUDA graphs; False calls
    them through IREE's runtime, which runs them on its own stream and waits for them.
    dependent_launch (stream launches): launch each kernel as a programmatic dependent launch, its
    launch overlapping the previous kernel's tail; None (default): where the GPU has them (sm_90+).
    l2_evict_first (stream launches): kernels that read each K/V page once (`spec.kv_read_once`:
    decode with one query token a sequence) mark their global loads L2 evict-first
    (msa_iree.launch.with_l2_evict_first); False launches the PTX as IREE wrote it.
    """

    _devices: dict[str, object] = {}

    def __init__(self, target: str = "host", build_dir=None, *, compile_missing=True, log=None,
                 stream_launch: bool = True, dependent_launch: bool | None = None, l2_evict_first: bool = True):
        self.target = check_target(target)
        self.driver = DRIVERS[target]
        self.build_dir = pathlib.Path(build_dir) if build_dir else None
        self.compile_missing = compile_missing
        # cuda: in-place kernels whose build saved a launch plan run on torch's current stream
        # (msa_iree.launch: queued, not waited for); else through IREE's synchronous call
        self.stream_launch = stream_launch and self.driver == "cuda"
        # stream launches as programmatic dependent launches (each kernel's launch overlaps the
        # tail of the kernel before it): None = where the GPU has them (sm_90 and later)
        self._dependent_launch_wanted = dependent_launch
        self.l2_evict_first = l2_evict_first
        self._stream_kernels = {}
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.manifest = self._read_manifest() if self.build_dir else {"kernels": {}}
        self._functions = {}
        self._entries = {}
        self._unit_scales = {}  # device -> [>= 64, 1] f32 ones (the scale operand of 16-bit caches)

    def unit_scale(self, num_kv_heads: int, device) -> torch.Tensor:
        """[H, 1] f32 ones on `device`, the scale operand of a 16-bit cache (the attend's and the KV
        insert's): rows of one buffer made once per device (64 rows, more if asked), contiguous, so
        that a call allocates and copies nothing (and queues no kernel) for it."""
        ones = self._unit_scales.get(device)
        if ones is None or ones.shape[0] < num_kv_heads:
            ones = self._unit_scales[device] = torch.ones(max(64, num_kv_heads), 1, device=device)
        return ones[:num_kv_heads]

    @property
    def config(self):
        """The IREE device config, created on first use: one per driver per process."""
        import iree.runtime as rt

        if self.driver not in KernelLibrary._devices:
            if self.driver in DRIVER_FLAGS:
                rt.flags.parse_flags(*DRIVER_FLAGS[self.driver])
            KernelLibrary._devices[self.driver] = rt.Config(self.driver)
        return KernelLibrary._devices[self.driver]

    def _read_manifest(self):
        path = self.build_dir / "manifest.json"
        if not path.exists():
            raise BuildMismatchError(f"build_dir: expected {path} (run `msa-iree compile --target {self.target} "
                                     f"--out {self.build_dir}`), got no manifest")
        m = json.loads(path.read_text())
        if m.get("iree_compiler_version") != runtime_version():
            raise BuildMismatchError(f"{path}: expected modules built by IREE {runtime_version()} (the installed "
                                     f"runtime), got IREE {m.get('iree_compiler_version')}; rebuild with msa-iree compile")
        if m.get("target") != self.target:
            raise BuildMismatchError(f"{path}: expected target {self.target!r}, got {m.get('target')!r}")
        return m

    def function(self, spec: KernelSpec, entry: str = "main"):
        """The module's `entry` function (`main`; GPU-level kernels also export `chain`, n calls
        back to back for benchmarks)."""
        fn = self._entries.get((id(spec), entry))
        if fn is not None and fn[0] is spec:
            return fn[1]
        module = self._functions.get(spec.name)
        if module is None:
            module = self._functions[spec.name] = self._load(spec)
        self._entries[(id(spec), entry)] = (spec, module[entry])  # spec kept: its id stays unique
        return module[entry]

    def _load(self, spec):
        import iree.runtime as rt

        self._check_arch(spec)
        entry = self.manifest["kernels"].get(spec.name)
        if entry is not None:
            vmfb = self._verified(entry)
        elif self.compile_missing:
            from .compile import compiled_module

            self.log(f"msa-iree: compiling {spec.name} for {self.target} on demand "
                     f"(prebuild with: msa-iree compile --target {self.target} "
                     f"--num-heads {spec.cfg.num_heads} --num-kv-heads {spec.cfg.num_kv_heads} "
                     f"--kv-dtype {spec.cfg.kv_dtype})")
            vmfb, _, _ = compiled_module(spec, self.target)
        else:
            raise BuildMismatchError(f"{self.build_dir}: expected kernel {spec.name} in the manifest, got none")
        ctx = rt.SystemContext(config=self.config)
        ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb))
        return ctx.modules.module

    def _check_arch(self, spec):
        """A module built for a newer CUDA architecture (the e4m3fn mma attend: sm_89) fails to
        load on an older GPU with a driver JIT error: say which kernel needs what instead."""
        want = spec.cuda_arch
        if want is None or self.driver != "cuda" or not torch.cuda.is_available():
            return
        have = torch.cuda.get_device_capability()
        if have[0] * 10 + have[1] < want:
            raise RuntimeError(f"{spec.name}: expected a CUDA GPU of compute capability >= {want // 10}.{want % 10} "
                               f"(the kernel converts fp8 in hardware), got {have[0]}.{have[1]}; "
                               "use a bf16/fp16 KV cache on this GPU")

    def stream_kernel(self, spec: KernelSpec):
        """The kernel as a msa_iree.launch.StreamKernel when this library launches on torch's
        stream and the build saved the kernel's launch plan; else None (IREE's call)."""
        sk = self._stream_kernels.get(spec.name, False)
        if sk is False:
            sk = None
            entry = self.manifest["kernels"].get(spec.name) if self.stream_launch else None
            if entry is not None and "launch_plan" in entry:
                from .launch import StreamKernel

                self._check_arch(spec)
                vmfb, plan = (self._verified(e) for e in (entry, entry["launch_plan"]))
                sk = StreamKernel(spec.name, vmfb, plan.decode(), dependent_launch=self.dependent_launch,
                                  l2_evict_first=self.l2_evict_first and getattr(spec, "kv_read_once", False))
            self._stream_kernels[spec.name] = sk
        return sk

    @functools.cached_property
    def dependent_launch(self) -> bool:
        """Whether stream launches are programmatic dependent launches (msa_iree.launch.
        with_dependent_launch): by default where the current GPU has them (compute capability 9.0+)."""
        wanted = self._dependent_launch_wanted
        if not self.stream_launch or wanted is False:
            return False
        major, minor = torch.cuda.get_device_capability()
        if wanted and major < 9:
            raise ValueError(f"dependent_launch: expected a GPU of compute capability 9.0 or later "
                             f"(programmatic dependent launches), got {major}.{minor}; pass None or False")
        return major >= 9

    def _verified(self, entry) -> bytes:
        """The bytes of a file the manifest lists, checked against its recorded sha256."""
        data = (self.build_dir / entry["file"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise BuildMismatchError(f"{self.build_dir / entry['file']}: sha256 differs from the manifest; "
                                     "the build is corrupt or was modified: rebuild it")
        return data

    @property
    def zero_copy(self) -> bool:
        """True on GPU drivers: torch GPU tensors go in and come out through DLPack, uncopied."""
        return self.driver in DLPACK_DEVICE_TYPE

    def to_iree(self, t: torch.Tensor):
        """A kernel argument: a HAL buffer view over `t`'s own memory (GPU tensor on a GPU driver),
        else a host numpy array that IREE copies. Buffer views pass through unchanged."""
        if not isinstance(t, torch.Tensor):
            return t
        if self.zero_copy and t.device.type == "cuda":
            if t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
                t = t.view(torch.uint8)  # the modules read fp8 as bytes; DLPack need not know fp8
            if not t.is_contiguous():
                t = t.contiguous()
            # torch.utils.dlpack.to_dlpack: the C++ export, ~3x cheaper per call than Tensor.__dlpack__
            return self.config.device.from_dlpack_capsule(torch.utils.dlpack.to_dlpack(t))
        return to_numpy(t)

    def to_torch(self, result, dtype: torch.dtype) -> torch.Tensor:
        """A module result as a torch tensor. On GPU drivers: copied on the device into a fresh
        torch GPU tensor (IREE's cuda allocator cannot export its own buffers through DLPack)."""
        if not self.zero_copy:
            return from_iree(result, dtype)
        import iree.runtime as rt

        bv = result._buffer_view
        dst = torch.empty(bv.shape, dtype=dtype, device="cuda")
        dst_bv = self.to_iree(dst)
        device = self.config.device
        cb = rt.HalCommandBuffer(device)
        cb.copy(bv.get_buffer(), dst_bv.get_buffer(), 0, 0, bv.byte_length, end=True)
        done = device.create_semaphore(0)
        device.queue_execute(cb, [], [(done, 1)])
        done.wait(1)
        return dst

    def run(self, spec: KernelSpec, *args, out_dtypes=(), out=None):
        """Call a kernel on torch tensors; the call returns when the kernel has finished, except
        for a stream launch (see `stream_kernel`), which returns once the kernel is queued on the
        current stream (torch work after it on that stream sees its results).

        out: for kernels whose module takes its result storage (GPU-level kernels, `spec.
        output_storage`), the torch tensors the results are written into, in place; returned.
        Otherwise returns new torch tensors of `out_dtypes` (on the GPU for GPU drivers)."""
        if out is not None and not getattr(spec, "output_storage", False):
            raise ValueError(f"out: {spec.name} allocates its own results; call it without out=")
        if getattr(spec, "written_operands", None):
            sk = self.stream_kernel(spec)
            if sk is not None:
                return self._launch_on_stream(sk, [*args, *(out or ())], spec.written_operands, out)
        if self.zero_copy and any(isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in args):
            torch.cuda.current_stream().synchronize()  # IREE runs on its own stream: inputs must be ready
        if out is not None:
            self.function(spec)(*[self.to_iree(a) for a in (*args, *out)])
            return list(out)
        result = self.function(spec)(*[self.to_iree(a) for a in args])
        results = result if isinstance(result, (tuple, list)) else (result,)
        return [self.to_torch(r, d) for r, d in zip(results, out_dtypes)]

    @staticmethod
    def _launch_on_stream(sk, operands, written, out):
        """Queue the kernel on the current stream of the device of the operand it writes:
        stream-ordered with the torch work around it, so nothing is synchronised (the call returns
        before the kernel ends). `written`: the indices of the operands the kernel writes."""
        first = operands[written[0]]
        index = first.get_device() if isinstance(first, torch.Tensor) else -1
        if index < 0:
            raise ValueError(f"operand {written[0] % len(operands)}: expected a CUDA tensor (a stream launch writes "
                             f"device memory), got {getattr(first, 'device', type(first).__name__)}")
        tensors = list(operands)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.get_device() != index:
                raise ValueError(f"operand {i}: expected a torch tensor on {first.device} (a stream launch reads "
                                 f"device memory), got {t.device if isinstance(t, torch.Tensor) else type(t).__name__}")
            if not t.is_contiguous():
                if i in written or i - len(tensors) in written:
                    raise ValueError(f"operand {i}: expected a contiguous tensor (written in place), got "
                                     f"strides {t.stride()}")
                tensors[i] = t.contiguous()
        sk(tensors, _current_raw_stream(index))
        return list(out) if out is not None else []


# ---- per-step metadata (SPEC §7) -------------------------------------------------------------


def _written_tokens(slot_mapping):
    """(token index, slot) int32 of the tokens whose slot is not padding (-1): a host sync."""
    keep = (slot_mapping >= 0).nonzero().reshape(-1)
    return keep.int(), slot_mapping[keep].int()


@dataclasses.dataclass
class DecodeMetadata:
    block_table: torch.Tensor          # [num_decodes, cols] int32, unrebased
    seq_lens: torch.Tensor             # [num_decodes] int32
    decode_query_len: int
    page16_block_table: torch.Tensor   # view of the builder's stable buffer


@dataclasses.dataclass
class PrefillMetadata:
    block_table: torch.Tensor          # [num_prefills, cols], request ids relative to the prefills
    cu_seqlens_q: torch.Tensor         # [num_prefills + 1] int32, from 0
    seq_lens: torch.Tensor
    context_lens: torch.Tensor         # prefix already computed
    query_req_id: torch.Tensor         # [num_prefill_tokens] int32
    query_abs_pos: torch.Tensor
    page16_block_table: torch.Tensor


@dataclasses.dataclass
class MsaMetadata:
    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None
    slot_mapping: torch.Tensor              # [num_tokens] logical slots, -1 = padding
    insert_token_index: torch.Tensor        # [M] int32 tokens to write (see insert_slots)
    insert_slots: torch.Tensor              # [M] int32 their logical slots: padding dropped, or (the
                                            # GPU writer, slot_capacity set) every token's, -1 = skip, at
                                            # addresses kept across steps
    slot_capacity: int | None = None        # the builder checked every slot below this many tokens


class MetadataBuilder:
    """Builds per-step metadata once for all sparse layers (SPEC §7.1-7.2).

    page16_block_table_buffer: [max_num_seqs, cdiv(max_model_len, 128)] int32, allocated here and
    kept at one address across steps (a captured decode replays through it).

    With num_cache_blocks and a library whose KV insert is the GPU writer (which skips slot -1),
    the step's slots are range-checked here, once, and passed to `insert_kv` whole (padding
    included) from buffers kept at one address: its per-layer calls then neither sync with the
    host nor change shape between steps of one size, so a decode step with its inserts can be
    captured in a CUDA graph.
    """

    def __init__(self, max_num_seqs: int, max_model_len: int, *, num_cache_blocks: int | None = None,
                 kernels: KernelLibrary | None = None, device="cpu"):
        self.kernels = kernels
        self.num_cache_blocks = num_cache_blocks
        cols = -(-max_model_len // BLOCK_SIZE)
        self.page16_block_table_buffer = torch.zeros(max_num_seqs, cols, dtype=torch.int32, device=device)
        self._insert_buffers = None  # (token index 0..n-1, slots) int32, grown to the largest step

    def build(self, block_table, seq_lens, query_start_loc, num_computed_tokens, decode_query_len: int,
              num_decodes: int, slot_mapping=None) -> MsaMetadata:
        """block_table [reqs, cols] int32; seq_lens, num_computed_tokens [reqs]; query_start_loc [reqs+1]."""
        num_reqs = seq_lens.shape[0]
        checks.check_dtype("block_table", block_table, torch.int32)
        checks.check_shape("block_table", block_table, (num_reqs, None))
        checks.check_shape("query_start_loc", query_start_loc, (num_reqs + 1,))
        checks.check_shape("num_computed_tokens", num_computed_tokens, (num_reqs,))
        if decode_query_len <= 0:
            raise ValueError(f"decode_query_len: expected > 0, got {decode_query_len}")
        if not 0 <= num_decodes <= num_reqs:
            raise ValueError(f"num_decodes: expected 0..num_reqs={num_reqs}, got {num_decodes}")
        qlens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
        bad = [q for q in qlens[:num_decodes] if q not in (decode_query_len, 0)]
        if bad:
            raise ValueError(f"decode query lengths: expected {decode_query_len} or 0 (graph padding) for the first "
                             f"num_decodes={num_decodes} requests, got {bad}")
        num_decode_tokens = num_decodes * decode_query_len
        num_tokens = int(query_start_loc[-1])
        if int(query_start_loc[num_decodes]) != num_decode_tokens:
            raise ValueError(f"num_decode_tokens: expected num_decodes * decode_query_len = {num_decode_tokens}, "
                             f"got {int(query_start_loc[num_decodes])} decode tokens in query_start_loc")
        buf = self.page16_block_table_buffer
        if num_reqs > buf.shape[0] or block_table.shape[1] > buf.shape[1]:
            raise ValueError(f"block table {(num_reqs, block_table.shape[1])} exceeds the page-16 rebase buffer "
                             f"{tuple(buf.shape)}")
        if self.num_cache_blocks is not None:
            checks.check_ids_in_range("block_table", block_table[block_table >= 0], self.num_cache_blocks)
        page16 = buf[:num_reqs, :block_table.shape[1]]
        page16.copy_(self._rebase(block_table))

        decode = prefill = None
        if num_decodes:
            decode = DecodeMetadata(block_table[:num_decodes], seq_lens[:num_decodes].int(), decode_query_len,
                                    page16[:num_decodes])
        if num_decodes < num_reqs:
            cu = (query_start_loc[num_decodes:] - query_start_loc[num_decodes]).int()
            ctx = num_computed_tokens[num_decodes:].int()
            req, pos = query_token_positions(cu, ctx, num_tokens - num_decode_tokens)
            prefill = PrefillMetadata(block_table[num_decodes:], cu, seq_lens[num_decodes:].int(), ctx, req, pos,
                                      page16[num_decodes:])
        if slot_mapping is None:
            slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int32)
        checks.check_shape("slot_mapping", slot_mapping, (None,))
        if slot_mapping.shape[0] < num_tokens:
            raise ValueError(f"slot_mapping: expected at least num_tokens={num_tokens} entries, "
                             f"got {slot_mapping.shape[0]}")
        slot_mapping = slot_mapping[:num_tokens]  # past the step's tokens: graph padding
        capacity = None
        if self.num_cache_blocks is not None:  # once per step, so that insert_kv need not per layer
            capacity = self.num_cache_blocks * BLOCK_SIZE
            checks.check_ids_in_range("slot_mapping", slot_mapping[slot_mapping >= 0], capacity)
        if capacity is not None and self.kernels is not None and self.kernels.target in InsertKvGpuSpec.targets:
            token_index, slots = self._stable_insert_buffers(slot_mapping)  # whole: the GPU writer skips -1
        else:
            token_index, slots = _written_tokens(slot_mapping)
        return MsaMetadata(num_tokens, num_decodes, num_decode_tokens, num_reqs - num_decodes,
                           num_tokens - num_decode_tokens, decode, prefill, slot_mapping, token_index, slots,
                           capacity)

    def _stable_insert_buffers(self, slot_mapping):
        """(0..n-1, the slots) as int32 views of buffers kept across steps (reallocated only for a
        larger step or another device), the slots copied in."""
        n, device = slot_mapping.shape[0], slot_mapping.device
        bufs = self._insert_buffers
        if bufs is None or bufs[0].shape[0] < n or bufs[0].device != device:
            size = max(n, 1)
            bufs = self._insert_buffers = (torch.arange(size, dtype=torch.int32, device=device),
                                           torch.empty(size, dtype=torch.int32, device=device))
        slots = bufs[1][:n]
        slots.copy_(slot_mapping)
        return bufs[0][:n], slots

    def _rebase(self, block_table):
        if self.kernels is None or block_table.numel() == 0:
            return block_table * 2
        (out,) = self.kernels.run(RebaseBlockTableSpec(MsaConfig()), block_table, out_dtypes=[torch.int32])
        return out


# ---- the attend ------------------------------------------------------------------------------


@dataclasses.dataclass
class _LayerState:
    """SparseAttention's per-layer operands (see SparseAttention._layer_state)."""
    stride: int                 # block page stride of the cache layout
    kp: torch.Tensor            # folded page views [pages * H, ...], storage dtype
    vp: torch.Tensor
    ks: torch.Tensor            # module scales [H, 1 or slots]
    vs: torch.Tensor
    operands: tuple             # (kp flat, vp flat, scale, ks, vs): keeps the viewed memory alive
    views: tuple                # the same as IREE views (GPU drivers) or tensors (host)
    refresh: tuple = ()         # stream launch: (contiguous copy, strided operand), copied per call


def _gpu_matrix(target, cfg, gpu_matrix):
    """The GPU attend variant to use: `gpu_matrix` checked against the target and config; "auto"
    is the target's matrix-core kernel where it supports cfg (mma on cuda, mfma on gfx942), else fma."""
    if gpu_matrix not in ("auto", "fma", "mma", "mfma"):
        raise ValueError(f"gpu_matrix: expected 'auto', 'fma', 'mma' or 'mfma', got {gpu_matrix!r}")
    if gpu_matrix == "auto":
        native = NATIVE_MATRIX.get(target)
        return native if native and GPU_ATTEND[native, target][0].supports(cfg) else "fma"
    if gpu_matrix == "fma":
        return "fma"
    specs = GPU_ATTEND.get((gpu_matrix, target))
    if specs is None or not specs[0].supports(cfg):
        where = "a cuda target" if gpu_matrix == "mma" else "a gfx942 (or, emulated for tests, cuda) target"
        raise ValueError(f"gpu_matrix={gpu_matrix!r}: expected {where}, 8 or 16 heads per KV head and an fp8 or "
                         f"query-dtype cache, got target {target!r}, {cfg.group_size} "
                         f"heads per KV head, a {cfg.kv_dtype} cache with {cfg.query_dtype} queries")
    return gpu_matrix


class SparseAttention:
    """MiniMax-M3 sparse attend over SHUFFLE page-16 caches, backed by compiled IREE modules."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float, kv_cache_dtype,
                 target: str = "host", *, build_dir=None, query_dtype=torch.bfloat16, kernels=None,
                 validate_emitted_tables: bool = True, gpu_matrix: str = "auto"):
        kv_name = kv_cache_dtype if isinstance(kv_cache_dtype, str) else dtype_name(kv_cache_dtype)
        self.cfg = MsaConfig(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_size, kv_dtype=kv_name,
                             query_dtype=dtype_name(query_dtype))
        self.kv_dtype = DTYPES[kv_name]
        self.kernels = kernels or KernelLibrary(target, build_dir)
        self.scale = scale
        self.scale_tensor = torch.tensor([scale], dtype=torch.float32)
        self._layer_key = None
        self._workspace = None  # (torch f32 tensor, its IREE view): the GPU attend's split partials
        self._decode_launch = None  # _DecodeLaunch: the last decode-only step's bound attend (stream launch)
        self._insert_launch = None  # _InsertLaunch: this layer's bound KV insert (stream launch)
        self._specs = {}  # (kernel class, decode L, stride) -> spec: built once, not per call
        self.validate_emitted_tables = validate_emitted_tables
        # the hand-written GPU attend (decode and prefill) where the target and head grouping allow it
        self.gpu_decode = (self.kernels.target in SparseAttnDecodeGpuSpec.targets
                           and SparseAttnDecodeGpuSpec.supports(self.cfg))
        self.gpu_matrix = _gpu_matrix(self.kernels.target, self.cfg, gpu_matrix)
        self.decode_spec, self.prefill_spec = GPU_ATTEND[self.gpu_matrix, self.kernels.target] \
            if self.gpu_decode else (SparseAttnDecodeGpuSpec, SparseAttnPrefillGpuSpec)

    # the folded page views the modules read: [pages * H, ...] (id = page * H + head)
    @staticmethod
    def _folded(cache):
        return cache.reshape(-1, *cache.shape[2:]).view(storage_dtype(cache.dtype))

    def _spec(self, cls, stride, decode_query_len=1):
        key = (cls, stride, decode_query_len)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = cls(self.cfg.replace(decode_query_len=decode_query_len), stride)
        return spec

    def _on(self, device):
        """The constant operands on `device` (moved once, then reused by every call)."""
        if self.scale_tensor.device != device:
            self.scale_tensor = self.scale_tensor.to(device)

    def _layer_state(self, k_cache, v_cache, k_scale, v_scale):
        """What depends only on the layer's cache and scale tensors, worked out once and reused
        while the same tensors come back (a layer passes the same ones every step): their checks,
        the folded page views, the module scales, and for the GPU attend their IREE views
        (a DLPack import costs ~1-5 us per tensor on an H200 host, tools/PERF.md)."""
        key = tuple(None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
                    for t in (k_cache, v_cache, k_scale, v_scale))
        if self._layer_key == key:
            return self._layer
        cfg = self.cfg
        checks.check_kv_cache(k_cache, v_cache, cfg.num_kv_heads, self.kv_dtype)
        stride = block_page_stride(k_cache, v_cache)
        capacity = k_cache.shape[0] // stride * BLOCK_SIZE
        checks.check_scale("k_scale", k_scale, self.kv_dtype, cfg.num_kv_heads, capacity)
        checks.check_scale("v_scale", v_scale, self.kv_dtype, cfg.num_kv_heads, capacity)
        self._on(k_cache.device)
        kp, vp = self._folded(k_cache), self._folded(v_cache)
        ks, vs = self._scales(k_scale, v_scale, k_cache.device)
        operands = (kp.reshape(kp.shape[0], -1), vp.reshape(vp.shape[0], -1), self.scale_tensor, ks, vs)
        refresh = ()
        if self.kernels.stream_launch:
            # launched on torch's stream: the tensors themselves; a strided one (a scalar scale
            # expanded over 2+ KV heads) through a contiguous copy refreshed on every call, so
            # that a scale changed in place is seen, as IREE's call (which copies it) sees it
            views, refresh = _contiguous_copies(operands)
        else:
            # only a zero-copy view can be reused (it reads the tensor's current bytes); anything
            # IREE would copy (host driver, a strided scale) is imported again on every call
            views = tuple(self.kernels.to_iree(t) if self.kernels.zero_copy and t.is_cuda and t.is_contiguous() else t
                          for t in operands)
        # operands keeps the memory the views point at alive
        self._layer = _LayerState(stride, kp, vp, ks, vs, operands, views, refresh)
        self._layer_key = key
        return self._layer

    def _step_views(self, phase, *names):
        """IREE views of a phase's metadata tensors (for stream launches the tensors, on the
        device), made by the first layer of a step and reused by the others (they share the
        step's metadata)."""
        cache = phase.__dict__.setdefault("_iree_views", {})
        views = cache.get(id(self.kernels))
        if views is None:
            if self.kernels.stream_launch:  # the tensors, on the query's device, contiguous
                device = self.scale_tensor.device
                views = {n: getattr(phase, n).to(device).contiguous() for n in names}
            else:
                views = {n: self.kernels.to_iree(getattr(phase, n)) for n in names}
            cache[id(self.kernels)] = views
        return [views[n] for n in names]

    def _workspace_for(self, spec, num_tokens, device):
        """The GPU attend's workspace (spec.workspace_floats), kept across calls and imported once;
        reallocated only when a larger batch needs more, so the steady hot path allocates nothing."""
        need = spec.workspace_floats(num_tokens)
        if self._workspace is None or self._workspace[0].numel() < need or self._workspace[0].device != device:
            ws = torch.empty(max(need, 1 << 20), dtype=torch.float32, device=device)
            zero_copy = self.kernels.zero_copy and not self.kernels.stream_launch
            self._workspace = (ws, self.kernels.to_iree(ws) if zero_copy else ws)
        return self._workspace[1]

    def _scales(self, k_scale, v_scale, device):
        h = self.cfg.num_kv_heads
        return tuple(self.kernels.unit_scale(h, device) if s is None else module_scale(s, h) for s in (k_scale, v_scale))

    def _check(self, query, k_cache, output, topk):
        """The per-call checks (the cache and scale checks run in _layer_state, once per tensor)."""
        cfg = self.cfg
        checks.check_query(query, cfg.num_heads)
        checks.check_dtype("query", query, cfg.query_torch_dtype)
        checks.check_device("k_cache", k_cache, query.device)
        checks.check_out(output, query)
        checks.check_topk(topk, cfg.num_kv_heads, None, cfg.topk)

    def insert_kv(self, key, value, k_cache, v_cache, metadata_or_slots, k_scale=None, v_scale=None):
        """This layer's KV insert: runtime.insert_kv (same arguments, checks and result; key/value
        [N, H, 128] bf16/fp16 written into k_cache/v_cache in place). Launched on torch's stream
        with slots the builder range-checked (MetadataBuilder(num_cache_blocks=...)), the later
        calls over the same caches, scales and step buffers go through a binding that checks only
        key and value: 47-71 -> 7-10 us of host time a call on an H200 (tools/PERF.md)."""
        bound = self._insert_launch
        if bound is not None and bound(metadata_or_slots, key, value, k_cache, v_cache, k_scale, v_scale):
            return
        self._insert_launch = None
        plan = _insert_plan(self.kernels, key, value, k_cache, v_cache, metadata_or_slots, k_scale, v_scale,
                            self.kv_dtype)
        if plan is None:
            return
        spec, operands, capacity = plan
        _run_insert(self.kernels, spec, operands)
        self._insert_launch = _InsertLaunch.bind(self.kernels, spec, metadata_or_slots,
                                                 (k_cache, v_cache, k_scale, v_scale), operands, capacity)

    def forward(self, query, k_cache, v_cache, output, topk, metadata: MsaMetadata, k_scale=None, v_scale=None,
                sparse_block_table=None, sparse_context_lens=None):
        """query/output [tokens, Hq, 128]; topk [H, >= tokens, K] int32. Returns `output`."""
        if not isinstance(metadata, MsaMetadata):
            return output  # profiling run: nothing to attend (SPEC §7.4)
        bound = self._decode_launch
        if (bound is not None and sparse_block_table is None and sparse_context_lens is None
                and bound(metadata, query, k_cache, v_cache, output, topk, k_scale, v_scale)):
            return output  # a later call of a bound step: only what changes per call was checked
        self._check(query, k_cache, output, topk)
        layer = self._layer_state(k_cache, v_cache, k_scale, v_scale)
        cfg, h = self.cfg, self.cfg.num_kv_heads
        nd, n = metadata.num_decode_tokens, metadata.num_actual_tokens
        if topk.shape[1] < n:
            raise ValueError(f"topk: expected at least num_actual_tokens={n} rows, got {topk.shape[1]}")
        stride = layer.stride
        emitted = checks.check_sparse_table(sparse_block_table, sparse_context_lens, None, cfg.topk)
        if emitted:
            if stride != PAGES_PER_BLOCK * 2:
                raise RuntimeError(f"the indexer emitted a page table for a block spanning {PAGES_PER_BLOCK * 2} pages, "
                                   f"but this KV cache lays a block out over {stride}. The page-16 rebase assumes both "
                                   "K/V sides share a block.")
            checks.check_shape("sparse_block_table", sparse_block_table, (None, cfg.topk * PAGES_PER_BLOCK))
            if sparse_block_table.shape[0] < n * h or sparse_context_lens.shape[0] < n * h:
                raise ValueError(f"sparse_block_table: expected at least num_actual_tokens * num_kv_heads = {n * h} "
                                 f"rows, got {sparse_block_table.shape[0]} and {sparse_context_lens.shape[0]}")
            if self.validate_emitted_tables:
                checks.check_ids_in_range("sparse_block_table", sparse_block_table[:n * h],
                                          min(k_cache.shape[0], v_cache.shape[0]) * h)
        kp, vp = layer.kp, layer.vp
        common = (self.scale_tensor, layer.ks, layer.vs)
        _refresh_copies(layer.refresh)
        for lo, hi, phase in ((0, nd, metadata.decode), (nd, n, metadata.prefill)):
            if hi == lo:
                continue
            q = _rows(query, lo, hi)
            if emitted:
                spec = self._spec(SparsePagedAttendSpec, stride)
                args = (q, kp, vp, sparse_block_table[lo * h:hi * h].reshape(hi - lo, h, -1),
                        sparse_context_lens[lo * h:hi * h].reshape(hi - lo, h), *common)
            elif phase is metadata.decode and self.gpu_decode:
                spec = self._spec(self.decode_spec, stride, phase.decode_query_len)
                kpv, vpv, scale_v, ksv, vsv = layer.views
                args = (q, kpv, vpv, _rows(topk, lo, hi, 1), *self._step_views(phase, "block_table", "seq_lens"),
                        scale_v, ksv, vsv)
            elif phase is metadata.decode:
                spec = self._spec(SparseAttnDecodeSpec, stride, phase.decode_query_len)
                args = (q, kp, vp, topk[:, lo:hi], phase.block_table, phase.seq_lens, *common)
            elif self.gpu_decode:
                spec = self._spec(self.prefill_spec, stride)
                kpv, vpv, scale_v, ksv, vsv = layer.views
                args = (q, kpv, vpv, _rows(topk, lo, hi, 1),
                        *self._step_views(phase, "block_table", "query_req_id", "query_abs_pos"), scale_v, ksv, vsv)
            else:
                spec = self._spec(SparseAttnPrefillSpec, stride)
                args = (q, kp, vp, topk[:, lo:hi], phase.block_table, phase.query_req_id, phase.query_abs_pos, *common)
            if getattr(spec, "output_storage", False):  # (checks.check_out: output is contiguous)
                ws = self._workspace_for(spec, hi - lo, query.device)
                self.kernels.run(spec, *args, out=[_rows(output, lo, hi), ws])  # written in place
                if phase is metadata.decode and self.gpu_decode and not emitted and metadata.prefill is None:
                    self._decode_launch = _DecodeLaunch.bind(self.kernels, spec, metadata, layer, (k_cache, v_cache,
                                                             k_scale, v_scale), (query, topk, output), args, ws)
                continue
            (o,) = self.kernels.run(spec, *args, out_dtypes=[query.dtype])
            output[lo:hi].copy_(o)
        return output

    __call__ = forward


class _LayerBinding:
    """What a layer's bound launches share (_DecodeLaunch, _InsertLaunch): the layer tensors a
    binding was made for, served only while the same objects at the same addresses come back (one
    changed by set_ or resize_ keeps its identity and is not seen; the binding keeps them alive
    until the next one), and the contiguous copies of strided operands refreshed before a launch."""

    def _hold(self, layer_tensors, refresh):
        """layer_tensors: (k_cache, v_cache, k_scale, v_scale); refresh: (copy, strided) pairs."""
        self.layer_tensors, self.refresh = layer_tensors, refresh
        self.cache_addresses = tuple(t.data_ptr() for t in layer_tensors[:2])

    def _same_layer(self, k_cache, v_cache, k_scale, v_scale) -> bool:
        k, v, ks, vs = self.layer_tensors
        return (k_cache is k and v_cache is v and k_scale is ks and v_scale is vs
                and (k_cache.data_ptr(), v_cache.data_ptr()) == self.cache_addresses)

    def _refresh(self):
        _refresh_copies(self.refresh)


def _contiguous_copies(tensors):
    """(the tensors, each strided one replaced by a contiguous copy; the (copy, strided) pairs to
    refresh before each launch, so that a strided operand changed in place is seen)."""
    copies = tuple(t.contiguous() for t in tensors)
    return copies, tuple((c, t) for c, t in zip(copies, tensors) if c is not t)


def _refresh_copies(refresh):
    """Copy each strided operand into its contiguous copy (_contiguous_copies' pairs)."""
    for copy, strided in refresh:
        copy.copy_(strided)


class _DecodeLaunch(_LayerBinding):
    """A layer's decode-only step bound to its stream launch (FlashInfer's plan/run split): made by
    a forward that ran every check, it serves the later calls that pass the same metadata, caches
    and scales, checking only what may change per call (the query, output and top-k tensors: the
    shapes, dtypes and device bound, contiguous) before it launches; any other call takes the
    checked path (and binds anew). It keeps the step's metadata alive until the next binding (and,
    as every _LayerBinding, the layer's tensors)."""

    @classmethod
    def bind(cls, kernels, spec, metadata, layer, layer_tensors, call_tensors, args, workspace):
        """None unless the attend is launched on torch's stream from the call tensors' own memory.
        layer_tensors: (k_cache, v_cache, k_scale, v_scale); call_tensors: (query, topk, output);
        args: the decode module's inputs as forward passed them (query rows at 0, top-k rows at 3)."""
        sk = kernels.stream_kernel(spec) if kernels.stream_launch else None
        query, topk, output = call_tensors
        # the kernel reads rows from the first: their addresses are the whole tensors' if contiguous
        if sk is None or not all(t.is_contiguous() for t in (*call_tensors, args[0], args[3])):
            return None
        self = cls()
        self.metadata = metadata
        self._hold(layer_tensors, layer.refresh)
        self.q_shape, self.q_dtype, self.topk_shape = query.shape, query.dtype, topk.shape
        self.device_index = query.get_device()
        out_rows = _rows(output, 0, args[0].shape[0])
        self.launch = sk.bind([*args, out_rows, workspace], variable=(0, 3, len(args)))
        return self

    def __call__(self, metadata, query, k_cache, v_cache, output, topk, k_scale, v_scale) -> bool:
        """Queue the attend if this call is one the binding serves (True); else False, nothing done."""
        if metadata is not self.metadata or not self._same_layer(k_cache, v_cache, k_scale, v_scale):
            return False
        q_shape, q_dtype, index = self.q_shape, self.q_dtype, self.device_index
        if (query.shape != q_shape or output.shape != q_shape or topk.shape != self.topk_shape
                or query.dtype != q_dtype or output.dtype != q_dtype or topk.dtype != torch.int32
                or query.get_device() != index or output.get_device() != index or topk.get_device() != index
                or not (query.is_contiguous() and output.is_contiguous() and topk.is_contiguous())):
            return False
        self._refresh()
        self.launch(_current_raw_stream(index), query.data_ptr(), topk.data_ptr(), output.data_ptr())
        return True


def _rows(t, lo, hi, dim=0):
    """Rows lo:hi of `t` along dim; `t` itself when that is all of it (a slice costs ~1-2 us of
    host time per call, and a decode-only step takes every row)."""
    if lo == 0 and hi == t.shape[dim]:
        return t
    return t[lo:hi] if dim == 0 else t[:, lo:hi]


def insert_kv(kernels: KernelLibrary, key, value, k_cache, v_cache, metadata_or_slots, k_scale=None, v_scale=None, *,
              kv_cache_dtype=None):
    """Write key/value [N, H, 128] into the SHUFFLE views in place through the compiled writer.

    metadata_or_slots: an MsaMetadata (its per-step compacted slots) or a [N] logical slot mapping.
    The views must be the layout's own: one buffer (interleaved) or two planes back to back.
    (SparseAttention.insert_kv: the same for one layer, its later calls bound to the launch.)
    """
    plan = _insert_plan(kernels, key, value, k_cache, v_cache, metadata_or_slots, k_scale, v_scale, kv_cache_dtype)
    if plan is not None:
        _run_insert(kernels, *plan[:2])


def _insert_plan(kernels, key, value, k_cache, v_cache, metadata_or_slots, k_scale, v_scale, kv_cache_dtype):
    """Every check of an insert; (spec, operands [cache buffer, key, value, token index, slots,
    k scale, v scale], capacity) to write, or None when there is nothing to write."""
    h = k_cache.shape[1]
    checks.check_kv_cache(k_cache, v_cache, h, kv_cache_dtype)
    checks.check_shape("key", key, (None, h, 128))
    checks.check_shape("value", value, tuple(key.shape))
    checks.check_dtype("key", key, (torch.bfloat16, torch.float16))
    checks.check_dtype("value", value, key.dtype)
    stride = block_page_stride(k_cache, v_cache)
    capacity = k_cache.shape[0] // stride * BLOCK_SIZE
    checks.check_scale("k_scale", k_scale, k_cache.dtype, h, capacity)
    checks.check_scale("v_scale", v_scale, k_cache.dtype, h, capacity)
    checked = False
    if isinstance(metadata_or_slots, MsaMetadata):
        md = metadata_or_slots
        if key.shape[0] < md.num_actual_tokens:
            raise ValueError(f"key: expected at least num_actual_tokens={md.num_actual_tokens} rows (the step's "
                             f"tokens), got {key.shape[0]}")
        token_index, slots = md.insert_token_index, md.insert_slots
        # range-checked by the builder against at most this cache's capacity: no host sync here
        checked = md.slot_capacity is not None and md.slot_capacity <= capacity
        if md.slot_capacity is not None and kernels.target not in InsertKvGpuSpec.targets:
            keep = (slots >= 0).nonzero().reshape(-1)  # the portable writer takes written tokens only
            token_index, slots = token_index[keep], slots[keep]
    else:
        checks.check_shape("slot_mapping", metadata_or_slots, (key.shape[0],))
        token_index, slots = _written_tokens(metadata_or_slots)
    if slots.numel() == 0:
        return None
    if not checked:
        checks.check_ids_in_range("slot_mapping", slots[slots >= 0], capacity)
    cfg = MsaConfig(num_kv_heads=h, kv_dtype=dtype_name(k_cache.dtype), query_dtype=dtype_name(key.dtype))
    # no scale (16-bit caches): ones on the cache's device (a stream launch reads device memory)
    ks, vs = (kernels.unit_scale(h, k_cache.device) if s is None else module_scale(s, h) for s in (k_scale, v_scale))
    raw = _whole_buffer(k_cache, v_cache).view(storage_dtype(k_cache.dtype))
    spec_cls = InsertKvGpuSpec if kernels.target in InsertKvGpuSpec.targets else InsertKvSpec
    return spec_cls(cfg, stride), [raw, key, value, token_index, slots, ks, vs], capacity


def _run_insert(kernels, spec, operands):
    if isinstance(spec, InsertKvGpuSpec):  # in place: the module writes into the cache's own memory
        kernels.run(spec, *operands, out_dtypes=())
        return
    raw = operands[0]
    (updated,) = kernels.run(spec, *operands, out_dtypes=[raw.dtype])
    raw.copy_(updated)  # host CPU: the portable module returns the updated buffer


class _InsertLaunch(_LayerBinding):
    """A layer's KV insert bound to its stream launch: made after a fully checked insert whose
    slots the builder range-checked (MsaMetadata.slot_capacity), it serves later calls with the
    same caches and scales and metadata whose token index and slots are the same buffers (the
    builder keeps them at one address from step to step), checking only key and value (shape,
    dtype, device, contiguous) before it queues the writer; any other call takes the checked path."""

    @classmethod
    def bind(cls, kernels, spec, metadata, layer_tensors, operands, capacity):
        """None unless the insert is a stream launch of builder-checked slots from contiguous key/value."""
        sk = kernels.stream_kernel(spec) if kernels.stream_launch else None
        key, value, token_index, slots = operands[1:5]
        if (sk is None or not isinstance(metadata, MsaMetadata) or metadata.slot_capacity is None
                or metadata.slot_capacity > capacity
                or not all(t.is_contiguous() for t in (key, value, token_index, slots))):
            return None
        self = cls()
        self.capacity = capacity
        self.step_buffers = tuple((t.data_ptr(), t.shape) for t in (token_index, slots))
        self.key_shape, self.key_dtype, self.device_index = key.shape, key.dtype, key.get_device()
        # a strided scale (one scale over 2+ KV heads) through a contiguous copy refreshed per call
        tensors, refresh = _contiguous_copies(operands)
        self._hold(layer_tensors, refresh)
        self.launch = sk.bind(list(tensors), variable=(1, 2))
        return self

    def __call__(self, metadata, key, value, k_cache, v_cache, k_scale, v_scale) -> bool:
        """Queue the insert if this call is one the binding serves (True); else False, nothing done."""
        if (not self._same_layer(k_cache, v_cache, k_scale, v_scale) or not isinstance(metadata, MsaMetadata)
                or metadata.slot_capacity is None or metadata.slot_capacity > self.capacity):
            return False
        ti, sl = metadata.insert_token_index, metadata.insert_slots
        if ((ti.data_ptr(), ti.shape), (sl.data_ptr(), sl.shape)) != self.step_buffers:
            return False
        shape, index = self.key_shape, self.device_index
        if (key.shape != shape or value.shape != shape or key.dtype != self.key_dtype or value.dtype != self.key_dtype
                or key.get_device() != index or value.get_device() != index
                or not (key.is_contiguous() and value.is_contiguous())):
            return False
        self._refresh()
        self.launch(_current_raw_stream(index), key.data_ptr(), value.data_ptr())
        return True


def _whole_buffer(k_cache, v_cache):
    """The single buffer both views live in, as [pages, H*16*128] (K at row P, V after it)."""
    row = k_cache[0].numel()
    esize = k_cache.element_size()
    if sides_are_packed(k_cache, v_cache):
        ok = v_cache.data_ptr() == k_cache.data_ptr() + PAGES_PER_BLOCK * row * esize
        pages = k_cache.shape[0]
    else:
        ok = v_cache.data_ptr() == k_cache.data_ptr() + k_cache.shape[0] * row * esize
        pages = 2 * k_cache.shape[0]
    if not (ok and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache, v_cache: expected the views of one SHUFFLE buffer (layout.allocate_kv_cache: "
                         "V 8 pages after K when interleaved, the V plane right after the K plane), got unrelated tensors")
    return torch.as_strided(k_cache, (pages, row), (row, 1))
