"""The compiled kernels of one target, loaded from a build directory, on torch tensors.

`KernelLibrary` loads a build's modules (checking the IREE version, the target and every file's
sha256 against its manifest), calls them on torch tensors and, on CUDA, launches the in-place
GPU kernels on torch's current stream (runtime/cuda_launch.py). On the host CPU (`local-task`)
tensors are copied through numpy; on `cuda`/`hip`, torch tensors that live on the GPU are imported
into IREE zero-copy through DLPack.
"""
from __future__ import annotations

import functools
import hashlib
import json
import pathlib
import sys

import numpy as np
import torch
import torch.utils.dlpack

from ..compile import DRIVERS, BuildMismatchError, check_target, runtime_version
from ..ops import KernelSpec


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
# for one-shot command buffers: 164 vs 216 us per decode forward at B=8 on an H200 (benchmarks/PERF.md).
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


def build_command(spec: KernelSpec, target: str, out=None) -> str:
    """The `msa-iree compile` command whose kernel set holds `spec` (for a kernel outside every
    set, the call that builds it alone)."""
    from ..ops import indexer_set, kernel_set
    from ..ops.indexer import FP8_QUERIES_CACHE, indexer_config

    c = spec.cfg
    lens = (1, 2, 3, 4, c.decode_query_len)
    attend = spec.name in {s.name for s in kernel_set(c, decode_query_lens=lens, target=target)}
    index_cfg = indexer_config(c.num_kv_heads, c.kv_dtype, c.query_dtype)
    forced = (getattr(spec, "init_blocks", 0), getattr(spec, "local_blocks", 1))
    fp8_queries = getattr(spec, "fp8_queries", False)
    index = not attend and spec.name in {s.name for s in indexer_set(index_cfg, target, *forced,
                                                                      fp8_queries=fp8_queries).specs()}
    if not attend and not index:
        return (f"msa_iree.compile.build(None, [{target!r}], {str(out or 'build')!r}, specs=[spec]) for this spec "
                "(no `msa-iree compile` kernel set holds it)")
    kv = "fp8" if index else c.kv_dtype  # an indexer kernel's kv_dtype is its index cache's
    cmd = [f"msa-iree compile --target {target} --num-heads {c.num_heads} --num-kv-heads {c.num_kv_heads} "
           f"--kv-dtype {kv} --query-dtype {c.query_dtype}"]
    if index:
        cmd.append(f"--index-cache-dtype {c.kv_dtype} --index-init-blocks {forced[0]} --index-local-blocks {forced[1]}")
        if fp8_queries:
            cmd.append(f"--index-query-dtype {FP8_QUERIES_CACHE}")
    if c.decode_query_len not in (1, 2, 3, 4):
        cmd.append(f"--decode-query-lens 1,2,3,4,{c.decode_query_len}")
    if out is not None:
        cmd.append(f"--out {out}")
    return " ".join(cmd)


class KernelLibrary:
    """The compiled kernels of one target on one IREE device, loaded from a build directory.

    build_dir: what `msa-iree compile --target <target> --out <build_dir>` wrote. A kernel the
    build lacks is an error naming the command that builds it, unless compile_missing=True: then
    it is compiled on first use (seconds to a minute each) into the shared content cache
    (MSA_IREE_CACHE), which is what a library without a build directory needs.

    stream_launch (cuda, hip): kernels that write in place and whose build saved a launch plan
    (every cuda and gfx942 build of `msa-iree compile` does) are launched on torch's current stream
    by runtime/cuda_launch.py or runtime/hip_launch.py (the latter NOT RUN: no AMD GPU was
    available), queued rather than waited for, and capturable by CUDA / HIP graphs; False calls them
    through IREE's runtime, which runs them on its own stream and waits for them.
    dependent_launch (CUDA stream launches): launch each kernel as a programmatic dependent launch,
    its launch overlapping the previous kernel's tail; None (default): where the GPU has them (sm_90+).
    l2_evict_first (CUDA stream launches): kernels that read each K/V page once
    (`spec.kv_read_once`: decode with one query token a sequence) mark their global loads L2
    evict-first (cuda_launch.with_l2_evict_first); False launches the PTX as IREE wrote it.
    """

    _devices: dict[str, object] = {}

    def __init__(self, target: str = "host", build_dir=None, *, compile_missing=False, log=None,
                 stream_launch: bool = True, dependent_launch: bool | None = None, l2_evict_first: bool = True):
        self.target = check_target(target)
        self.driver = DRIVERS[target]
        self.build_dir = pathlib.Path(build_dir) if build_dir else None
        self.compile_missing = compile_missing
        # cuda: in-place kernels whose build saved a launch plan run on torch's current stream
        # (runtime/cuda_launch.py, runtime/hip_launch.py: queued, not waited for); else IREE's synchronous call
        self.stream_launch = stream_launch and self.driver in ("cuda", "hip")
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
        self._workspaces = {}  # (owner, device) -> (f32 tensor, what a call passes: its IREE view or itself)

    def unit_scale(self, num_kv_heads: int, device) -> torch.Tensor:
        """[H, 1] f32 ones on `device`, the scale operand of a 16-bit cache (the attend's and the KV
        insert's): rows of one buffer made once per device (64 rows, more if asked), contiguous, so
        that a call allocates and copies nothing (and queues no kernel) for it."""
        ones = self._unit_scales.get(device)
        if ones is None or ones.shape[0] < num_kv_heads:
            ones = self._unit_scales[device] = torch.ones(max(64, num_kv_heads), 1, device=device)
        return ones[:num_kv_heads]

    def workspace(self, floats: int, device, owner: str = "attend"):
        """Scratch for the GPU kernels of `owner` ("attend": the attend's counters and
        split partials, `spec.workspace_floats`; "indexer": the indexer's), one per device and
        owner, shared by every layer that calls through this library: their kernels run one after
        another on one stream, so one layer's partials are consumed before the next layer's are
        written. The attend's starts zeroed (its counters must be zero before a call and
        every call leaves them so; the indexer's kernels never touch it). Grown (reallocated,
        never below 1 MiB) when a call needs more, so the steady state allocates nothing; a launch
        bound to the old buffer keeps it alive. Returns what a call passes: the tensor, or its
        IREE view for IREE's own call on a GPU driver."""
        if owner not in ("attend", "indexer"):
            raise ValueError(f"owner: expected 'attend' or 'indexer', got {owner!r}")
        ws = self._workspaces.get((owner, device))
        if ws is None or ws[0].numel() < floats:
            size = max(floats, 1 << 18, 2 * ws[0].numel() if ws else 0)
            t = (torch.zeros if owner == "attend" else torch.empty)(size, dtype=torch.float32, device=device)
            ws = self._workspaces[owner, device] = (t, self.to_iree(t) if self.zero_copy and not self.stream_launch else t)
        return ws[1]

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
            from ..compile import compiled_module, is_cached

            if not is_cached(spec, self.target):
                self.log(f"msa-iree: compiling {spec.name} for {self.target} on demand (prebuild the set with: "
                         f"{build_command(spec, self.target)})")
            vmfb, _, _ = compiled_module(spec, self.target)
        else:
            where = f"{self.build_dir}: expected kernel {spec.name} in the manifest" if self.build_dir else \
                f"kernel {spec.name}: expected a build directory that holds it"
            raise BuildMismatchError(f"{where}, got none; build it with `{build_command(spec, self.target, self.build_dir)}` "
                                     "(or make the library with compile_missing=True)")
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
        """The kernel as a StreamKernel (cuda) or HipStreamKernel (hip) when this library launches on torch's
        stream and the build saved the kernel's launch plan; else None (IREE's call)."""
        key = (spec.name, getattr(spec, "kv_read_once", False))  # one module, loaded with or without the hint
        sk = self._stream_kernels.get(key, False)
        if sk is False:
            sk = None
            entry = self.manifest["kernels"].get(spec.name) if self.stream_launch else None
            if entry is not None and "launch_plan" in entry:
                self._check_arch(spec)
                vmfb, plan = (self._verified(e) for e in (entry, entry["launch_plan"]))
                if self.driver == "hip":  # NOT RUN: no AMD GPU was available
                    from .hip_launch import HipStreamKernel

                    sk = HipStreamKernel(spec.name, vmfb, plan.decode())
                else:
                    from .cuda_launch import StreamKernel

                    sk = StreamKernel(spec.name, vmfb, plan.decode(), dependent_launch=self.dependent_launch,
                                      l2_evict_first=self.l2_evict_first and getattr(spec, "kv_read_once", False))
            self._stream_kernels[key] = sk
        return sk

    @functools.cached_property
    def dependent_launch(self) -> bool:
        """Whether stream launches are programmatic dependent launches (cuda_launch.
        with_dependent_launch): by default where the current GPU has them (compute capability 9.0+)."""
        wanted = self._dependent_launch_wanted
        if not self.stream_launch or self.driver != "cuda" or wanted is False:
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
