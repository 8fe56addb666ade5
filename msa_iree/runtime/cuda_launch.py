"""Stream-ordered launches of the CUDA GPU kernels: IREE's compiled PTX on torch's stream.

IREE's CUDA runtime runs a module on a stream of its own and can neither wait on torch's stream
nor signal it, so a call into it is synchronous: ~40 us above the kernel on an H200 (benchmarks/PERF.md).
For the GPU-level kernels that write only into operands they are given (`spec.written_operands`:
the attend's output and workspace, the insert's cache), this module launches the same PTX with
the CUDA driver API on torch's current stream instead. What
IREE's host code would do is read from `main` as IREE lowered it (`--compile-to=hal`, saved next
to the vmfb at build time, `launch_plan` in the manifest): each dispatch's grid, push constants
and bindings are computed by interpreting that straight-line code for the operands' shapes, and its
asserts (operand shapes and element types, the workspace size) are checked the same way. The call
returns once the kernels are queued, ordered with torch's work like any torch op.

CUDA only. `DispatchPlan` interprets the subset of ops `main` uses and raises on any other, so a
new IREE version that lowers differently fails loudly; the GPU tests compare every stream-launched
kernel with IREE's own call of it, byte for byte. Not thread-safe: one `StreamKernel` reuses its
argument buffers.
"""
from __future__ import annotations

import ctypes
import re
import struct

_BINARY = {"muli": lambda a, b: a * b, "addi": lambda a, b: a + b, "subi": lambda a, b: a - b,
           "divui": lambda a, b: a // b, "remui": lambda a, b: a % b, "andi": lambda a, b: a & b,
           "ori": lambda a, b: a | b, "xori": lambda a, b: a ^ b, "shrui": lambda a, b: a >> b,
           "shli": lambda a, b: a << b, "maxui": max, "minui": min, "maxsi": max, "minsi": min}
_COMPARE = {"eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "ult": lambda a, b: a < b,
            "ule": lambda a, b: a <= b, "ugt": lambda a, b: a > b, "uge": lambda a, b: a >= b,
            "slt": lambda a, b: a < b, "sle": lambda a, b: a <= b, "sgt": lambda a, b: a > b,
            "sge": lambda a, b: a >= b}
# HAL element type -> the torch dtypes an operand of it may have (fp8 caches travel as bytes)
_ELEMENT_DTYPES = {"bf16": ("bfloat16",), "f16": ("float16",), "f32": ("float32",), "i32": ("int32",),
                   "i8": ("int8", "uint8", "float8_e4m3fn", "float8_e4m3fnuz"),
                   "ui8": ("uint8", "int8", "float8_e4m3fn", "float8_e4m3fnuz")}


class DispatchPlan:
    """`main`'s dispatches, evaluated for given operand shapes and dtypes."""

    def __init__(self, main_text: str):
        self.lines = [ln.strip() for ln in main_text.splitlines() if ln.strip()]

    def evaluate(self, shapes, dtypes):
        """[(kernel, grid, [u32 constants], [(operand, byte offset)])], after `main`'s checks
        (operand shape and element type, its cf.asserts): ValueError naming the operand."""
        env, functions, dispatches = {}, {}, []
        lines, i = self.lines, 0
        while i < len(lines):
            ln, i = lines[i], i + 1
            if m := re.fullmatch(r"(%\S+) = arith\.constant (-?\d+|true|false) : \S+", ln):
                env[m[1]] = {"true": 1, "false": 0}[m[2]] if m[2] in ("true", "false") else int(m[2])
            elif m := re.fullmatch(r"(%\S+) = arith\.(\w+) (%\S+), (%\S+) : \S+", ln):
                if m[2] not in _BINARY:
                    raise NotImplementedError(f"main: arith.{m[2]} is not interpreted ({ln})")
                env[m[1]] = _BINARY[m[2]](env[m[3]], env[m[4]])
            elif m := re.fullmatch(r"(%\S+) = arith\.cmpi (\w+), (%\S+), (%\S+) : \S+", ln):
                env[m[1]] = int(_COMPARE[m[2]](env[m[3]], env[m[4]]))
            elif m := re.fullmatch(r"(%\S+) = arith\.select (%\S+), (%\S+), (%\S+) : \S+", ln):
                env[m[1]] = env[m[3]] if env[m[2]] else env[m[4]]
            elif m := re.fullmatch(r"(%\S+) = arith\.(index_castui|index_cast|extui|trunci) (%\S+) : \S+ to (\S+)", ln):
                env[m[1]] = env[m[3]] & 0xFFFFFFFF if m[4] == "i32" else env[m[3]]
            elif m := re.fullmatch(r"(%\S+) = hal\.element_type<(\w+)> : i32", ln):
                env[m[1]] = m[2]
            elif m := re.fullmatch(r"(%\S+) = hal\.buffer_view\.dim<%arg(\d+) : !hal\.buffer_view>\[(\d+)\] : index", ln):
                env[m[1]] = shapes[int(m[2])][int(m[3])]
            elif m := re.fullmatch(r"(%\S+) = hal\.buffer_view\.buffer<%arg(\d+) : .*", ln):
                env[m[1]] = int(m[2])
            elif m := re.fullmatch(r"hal\.buffer_view\.assert<%arg(\d+) : !hal\.buffer_view> message\(\"(\w+)\"\) "
                                   r"shape\(\[(.*?)\]\) type\((%\S+)\) encoding\(\S+\)", ln):
                k = int(m[1])
                want = tuple(env[v.strip()] for v in m[3].split(",")) if m[3].strip() else ()
                if tuple(shapes[k]) != want:
                    raise ValueError(f"{m[2]} (operand {k}): expected shape {want}, got {tuple(shapes[k])}")
                if dtypes[k] not in _ELEMENT_DTYPES.get(env[m[4]], (env[m[4]],)):
                    raise ValueError(f"{m[2]} (operand {k}): expected element type {env[m[4]]}, got {dtypes[k]}")
            elif m := re.fullmatch(r"cf\.assert (%\S+), \"(.*)\"", ln):
                if not env[m[1]]:
                    raise ValueError(m[2])
            elif m := re.fullmatch(r"(%\S+) = hal\.executable\.lookup\.function .*::@(\w+)\) : i64", ln):
                functions[m[1]] = m[2]
            elif m := re.match(r"hal\.command_buffer\.dispatch<.*\[(%\S+)\] workgroups\(\[(.*?)\]\) "
                               r"constants\(\[(.*?)\]\) bindings\(\[$", ln):
                grid = [env[v.strip()] for v in m[2].split(",")]
                constants = [env[v.strip()] & 0xFFFFFFFF for v in m[3].split(",")] if m[3].strip() else []
                bindings = []
                while not lines[i].startswith("])"):
                    b = re.fullmatch(r"\((%\S+) : !hal\.buffer\)\[(%\S+), (%\S+)\],?", lines[i])
                    bindings.append((env[b[1]], env[b[2]]))
                    i += 1
                dispatches.append((functions[m[1]], grid, constants, bindings))
            elif re.match(r"(%\S+ = )?(arith|cf|scf)\.", ln):
                raise NotImplementedError(f"main: not interpreted: {ln}")
        return dispatches


def ptx_of(vmfb: bytes) -> bytes:
    """The PTX IREE stored in a cuda module (a length-prefixed string in its executable)."""
    marker = b"//\n// Generated by LLVM NVPTX Back-End"
    if vmfb.count(marker) != 1:
        raise ValueError(f"vmfb: expected a cuda module with one PTX executable, got {vmfb.count(marker)}")
    at = vmfb.find(marker)
    (n,) = struct.unpack_from("<I", vmfb, at - 4)
    return vmfb[at:at + n].rstrip(b"\0")


def with_dependent_launch(ptx: str) -> str:
    """The PTX with each kernel made ready for a programmatic dependent launch (sm_90's PDL): its
    first instruction waits for the kernel before it on the stream to have finished and its
    writes to be visible (`griddepcontrol.wait`). Launched with the programmatic-serialization
    attribute, a kernel is then launched as the previous one's workgroups retire (its implicit
    trigger) rather than after its end, so its launch overlaps that kernel's tail; without the
    attribute the wait is a no-op. No kernel triggers early (`griddepcontrol.launch_dependents`):
    on the H200 that made a decode step slower (the waiting workgroups hold SM slots;
    benchmarks/PERF.md). Needs PTX ISA 7.8 and sm_90, which the directives are raised to (IREE writes
    7.6 / sm_80; the JIT compiles for the device either way)."""
    version = re.search(r"^\.version (\d+)\.(\d+)$", ptx, re.M)
    target = re.search(r"^\.target sm_(\d+)$", ptx, re.M)
    if version is None or target is None:
        raise ValueError("ptx: expected `.version X.Y` and `.target sm_NN` lines")
    if (int(version[1]), int(version[2])) < (7, 8):
        ptx = ptx[:version.start()] + ".version 7.8" + ptx[version.end():]
    ptx = re.sub(r"^\.target sm_(\d+)$", lambda m: f".target sm_{max(int(m[1]), 90)}", ptx, count=1, flags=re.M)
    return _at_entry_starts(ptx, "\tgriddepcontrol.wait;\n")


def _at_entry_starts(ptx: str, text: str) -> str:
    """The PTX with `text` put in each entry after its register declarations, ahead of its first
    instruction (and of anything put there before)."""
    body = re.compile(r"(\.visible \.entry \w+\(.*?\)[^{]*\{\n(?:\s*\.reg [^\n]*\n|\s*\n)*)", re.S)
    ptx, n = body.subn(lambda m: m[1] + text, ptx)
    if n != len(ptx_entries(ptx)):
        raise ValueError(f"ptx: found the body of {n} of its {len(ptx_entries(ptx))} entries")
    return ptx


_L2_POLICY = "%msa_l2_evict_first"
_GLOBAL_LOAD = re.compile(r"\b(ld\.global(?:\.nc)?)((?:\.v[248])?\.[bsuf]\d+\s[^;\[]*\[[^\]]+\]);")
_ASYNC_COPY = re.compile(r"\b(cp\.async\.c[ag]\.shared\.global)(\s+\[[^\]]+\],\s*\[[^\]]+\],\s*\d+);")


def with_l2_evict_first(ptx: str) -> str:
    """The PTX with every global load (`ld.global`, `cp.async` from global memory) carrying an L2
    cache policy of evict-first (`createpolicy.fractional.L2::evict_first`, made once at each
    entry's start; PTX ISA 7.4, sm_80): the lines it brings in are the first L2 gives up, so a
    kernel that reads each byte once streams through L2 without pushing out what the kernels
    around it will read again (the next layer's inputs, the merge's partials, dirty lines).
    A hint: results do not change. Meant for kernels whose reads are not reused (a decode with
    one query token a sequence: `kv_read_once` of its spec); where rows share pages (several
    query tokens a sequence, prefill) it costs re-reads from memory (benchmarks/PERF.md). Raises if
    a global load it does not recognise would be left unhinted."""
    ptx, loads = _GLOBAL_LOAD.subn(rf"\1.L2::cache_hint\2, {_L2_POLICY};", ptx)
    ptx, copies = _ASYNC_COPY.subn(rf"\1.L2::cache_hint\2, {_L2_POLICY};", ptx)
    left = [ln.strip() for ln in ptx.splitlines()
            if re.search(r"\b(ld\.global|cp\.async\.\w+\.shared\.global)\b", ln) and _L2_POLICY not in ln]
    if left:
        raise ValueError(f"ptx: expected every global load in a form this rewrite knows, got {left[:3]}")
    if loads + copies == 0:
        return ptx
    return _at_entry_starts(ptx, f"\t.reg .b64 {_L2_POLICY};\n"
                                 f"\tcreatepolicy.fractional.L2::evict_first.b64 {_L2_POLICY}, 1.0;\n")


def ptx_entries(ptx: str) -> dict:
    """{kernel: (block dims, pointer params, 32-bit params)} of the PTX's entry points."""
    out = {}
    for m in re.finditer(r"\.visible \.entry (\w+)\((.*?)\)\s*\.maxntid (\d+), (\d+), (\d+)", ptx, re.S):
        out[m[1]] = ((int(m[3]), int(m[4]), int(m[5])), m[2].count(".u64"), m[2].count(".b32"))
    return out


def entries_using_shared(ptx: str) -> set:
    """The PTX's entry points whose body touches shared memory (a `.shared` access or the address
    of IREE's `__dynamic_shared_memory__`). IREE gives every kernel of a module the module's
    largest workgroup memory; one that touches none is launched with none here, so that it does
    not hold shared memory it never uses (on an SM beside the kernel before it, under PDL)."""
    starts = [(m.start(), m[1]) for m in re.finditer(r"\.visible \.entry (\w+)\(", ptx)]
    bodies = [(name, ptx[at:end]) for (at, name), (end, _) in zip(starts, starts[1:] + [(len(ptx), None)])]
    return {name for name, body in bodies if ".shared" in body or "__dynamic_shared_memory__" in body}


def shared_bytes(vmfb: bytes, block) -> int:
    """Dynamic shared memory IREE launches the module's kernels of `block` threads with: the u32
    after their block dims in its executable (the largest such, so never too little)."""
    key = struct.pack("<III", *block)
    sizes = [struct.unpack_from("<I", vmfb, m.end())[0] for m in re.finditer(re.escape(key), vmfb)]
    sizes = [s for s in sizes if s <= 227 * 1024]
    if not sizes:
        raise ValueError(f"vmfb: expected the shared memory size of its {block} kernels, found none")
    return max(sizes)


class CudaDriver:
    """The CUDA driver calls a launch needs (libcuda through ctypes; torch made its context current)."""

    _lib = None

    def __init__(self):
        if CudaDriver._lib is None:
            CudaDriver._lib = ctypes.CDLL("libcuda.so.1")
        self.lib = CudaDriver._lib

    def check(self, rc: int, what: str):
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what}: {name.value.decode() if name.value else rc}")

    def load(self, ptx: bytes, names):
        module = ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(ptx + b"\0")), "cuModuleLoadData")
        functions = {}
        for name in names:
            fn = ctypes.c_void_p()
            self.check(self.lib.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()), f"cuModuleGetFunction {name}")
            functions[name] = fn
        return module, functions


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte value union
    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int32 * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3), ("shared", ctypes.c_uint32),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint32)]


class _Launch:
    """One dispatch of a plan: its kernel, grid and a reusable argument block; with `dependent`, a
    reusable cuLaunchKernelEx configuration that makes it a programmatic dependent launch."""

    def __init__(self, fn, grid, block, shared, bindings, constants, dependent=False):
        self.fn, self.grid, self.block, self.shared, self.bindings = fn, grid, block, shared, bindings
        self.dependent = dependent
        self.pointers = [ctypes.c_uint64(0) for _ in bindings]
        self.constants = [ctypes.c_uint32(c) for c in constants]
        slots = self.pointers + self.constants
        self.args = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(s) for s in slots])
        self.config = None
        if dependent:
            self.attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
            self.attribute.value[0] = 1  # programmaticStreamSerializationAllowed
            self.config = _LaunchConfig((ctypes.c_uint32 * 3)(*grid), (ctypes.c_uint32 * 3)(*block), shared, None,
                                        ctypes.pointer(self.attribute), 1)
            self.config_ref = ctypes.byref(self.config)

    def launch(self, lib, stream: int) -> int:
        """Queue it on `stream` (the CUresult)."""
        if self.config is not None:
            self.config.stream = stream
            return lib.cuLaunchKernelEx(self.config_ref, self.fn, self.args, None)
        return lib.cuLaunchKernel(self.fn, self.grid[0], self.grid[1], self.grid[2], self.block[0], self.block[1],
                                  self.block[2], self.shared, ctypes.c_void_p(stream), self.args, None)


def _queue(driver, name, launches, stream: int):
    """Queue `launches` (their argument blocks written) on `stream`, in order; a failed launch raises."""
    lib = driver.lib
    for d in launches:
        rc = d.launch(lib, stream)
        if rc:
            driver.check(rc, f"{name}: launch")


class StreamKernel:
    """A cuda module's `main`, launched on a given stream (see the module docstring)."""

    def __init__(self, name: str, vmfb: bytes, plan_text: str, driver: CudaDriver | None = None,
                 dependent_launch: bool = False, l2_evict_first: bool = False):
        """dependent_launch: launch the kernels as programmatic dependent launches (sm_90 and
        later: see `with_dependent_launch`). l2_evict_first: their global loads carry an L2
        evict-first policy (`with_l2_evict_first`: for kernels that read each byte once)."""
        self.name = name
        self.driver = driver or CudaDriver()
        self.dependent_launch = dependent_launch
        self.l2_evict_first = l2_evict_first
        text = ptx_of(vmfb).decode()
        self.entries = ptx_entries(text)
        self.ptx = text
        if l2_evict_first:
            self.ptx = with_l2_evict_first(self.ptx)
        if dependent_launch:  # after: its wait stays each entry's first instruction
            self.ptx = with_dependent_launch(self.ptx)
        self.module, self.functions = self.driver.load(self.ptx.encode(), self.entries)
        uses_shared = entries_using_shared(text)
        self.shared = {n: shared_bytes(vmfb, e[0]) if n in uses_shared else 0 for n, e in self.entries.items()}
        self.plan = DispatchPlan(plan_text)
        self._launches = {}

    def _dispatches(self, tensors):
        """The dispatches of `main` for these operands' shapes and dtypes, worked out once and reused."""
        key = tuple((t.shape, t.dtype) for t in tensors)
        launches = self._launches.get(key)
        if launches is None:
            launches = self._launches[key] = self._prepare(tensors)
        return launches

    def _prepare(self, tensors):
        shapes = [tuple(t.shape) for t in tensors]
        dtypes = [str(t.dtype).replace("torch.", "") for t in tensors]
        launches = []
        for name, grid, constants, bindings in self.plan.evaluate(shapes, dtypes):
            block, n_pointers, n_words = self.entries[name]
            if (len(bindings), len(constants)) != (n_pointers, n_words):
                raise RuntimeError(f"{self.name}: main passes {name} {len(bindings)} bindings and {len(constants)} "
                                   f"constants, its PTX takes {n_pointers} and {n_words}")
            launches.append(_Launch(self.functions[name], grid, block, self.shared[name], bindings, constants,
                                    self.dependent_launch))
        return launches

    def __call__(self, tensors, stream: int):
        """Queue `main` on `stream` (a CUstream handle) over contiguous CUDA tensors in `main`'s
        operand order; the plan for their shapes and dtypes is worked out once and reused."""
        launches = self._dispatches(tensors)
        for d in launches:
            for slot, (k, offset) in zip(d.pointers, d.bindings):
                slot.value = tensors[k].data_ptr() + offset
        _queue(self.driver, self.name, launches, stream)

    def bind(self, tensors, variable):
        """`main` over these operands, of which those at the indices `variable` may move between
        calls: a BoundLaunch (the plan evaluated and every other pointer written once)."""
        return BoundLaunch(self, tensors, variable)


class BoundLaunch:
    """A StreamKernel's dispatches over operands fixed but for a few (`variable`) whose addresses
    are given per call: a call writes those addresses and queues the kernels, nothing else (the
    per-call host cost of a layer's attend, benchmarks/PERF.md). It keeps the fixed operands alive;
    the caller checks that the variable ones have the shapes and dtypes it was bound with."""

    def __init__(self, sk: StreamKernel, tensors, variable):
        self.name, self._driver = sk.name, sk.driver
        self._keep = list(tensors)
        self._launches = [_Launch(d.fn, d.grid, d.block, d.shared, d.bindings, [c.value for c in d.constants],
                                  d.dependent) for d in sk._dispatches(tensors)]  # argument blocks of its own
        self._moving = []  # (pointer slot, index into the call's addresses, byte offset)
        for d in self._launches:
            for slot, (k, offset) in zip(d.pointers, d.bindings):
                slot.value = tensors[k].data_ptr() + offset
                if k in variable:
                    self._moving.append((slot, variable.index(k), offset))

    def __call__(self, stream: int, *addresses):
        """Queue the kernels on `stream` with the variable operands at `addresses` (data_ptr()s, in
        the order of `variable`)."""
        for slot, i, offset in self._moving:
            slot.value = addresses[i] + offset
        _queue(self._driver, self.name, self._launches, stream)
