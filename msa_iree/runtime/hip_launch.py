"""Stream-ordered launches of the gfx942 GPU kernels: IREE's code object on torch's HIP stream.

NOT RUN: no AMD GPU was available. Everything but the HIP driver calls is tested on the CPU
(tests/test_hip_launch.py): the code object taken from the vmfb, its kernels' metadata (the
`.amdhsa` kernel descriptors' argument offsets, sizes and kinds, workgroup size, LDS), the check
that the launch plan passes each kernel exactly the arguments its code object declares, and the
argument blocks a launch would hand the driver.

IREE's HIP runtime, like its CUDA one, runs a module on a stream of its own and waits for it, and
a HIP graph cannot capture it. For the in-place GPU kernels (`spec.written_operands`) this module
launches the same code object with `hipModuleLaunchKernel` on torch's current stream instead,
with the grid, push constants and bindings IREE's host code would compute (runtime/launch_plan.py
interprets `main` as IREE lowered it): queued, not waited for, and capturable. The HIP calls go
through ctypes on libamdhip64 (the few a launch needs: load, lookup, launch, error name), not
hip-python, whose launch could not be measured here (benchmarks/PERF.md, decision record).
"""
from __future__ import annotations

import ctypes
import dataclasses
import struct

from .launch_plan import DispatchPlan, PlannedKernel

_EM_AMDGPU = 224           # ELF e_machine of an AMDGPU code object
_NT_AMDGPU_METADATA = 32   # the note holding the msgpack kernel metadata


def hsaco_of(vmfb: bytes) -> bytes:
    """The code object (an AMDGPU ELF) IREE stored in a gfx942 module."""
    at = vmfb.find(b"\x7fELF")
    found = []
    while at >= 0:
        if struct.unpack_from("<H", vmfb, at + 18)[0] == _EM_AMDGPU:
            found.append(at)
        at = vmfb.find(b"\x7fELF", at + 4)
    if len(found) != 1:
        raise ValueError(f"vmfb: expected a gfx942 module with one AMDGPU code object, got {len(found)}")
    at = found[0]
    shoff, = struct.unpack_from("<Q", vmfb, at + 0x28)
    shentsize, shnum = struct.unpack_from("<HH", vmfb, at + 0x3A)
    return vmfb[at:at + shoff + shentsize * shnum]


def _notes(elf: bytes):
    """(name, type, descriptor) of every note of the ELF's SHT_NOTE sections."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    for i in range(shnum):
        sh = shoff + i * shentsize
        sh_type, = struct.unpack_from("<I", elf, sh + 4)
        if sh_type != 7:  # SHT_NOTE
            continue
        off, size = struct.unpack_from("<QQ", elf, sh + 0x18)
        at = off
        while at < off + size:
            namesz, descsz, kind = struct.unpack_from("<III", elf, at)
            name = elf[at + 12:at + 12 + namesz].rstrip(b"\0").decode()
            desc_at = at + 12 + (namesz + 3) // 4 * 4
            yield name, kind, elf[desc_at:desc_at + descsz]
            at = desc_at + (descsz + 3) // 4 * 4


def _msgpack(data: bytes, at: int = 0):
    """(value, next offset) of the msgpack object at `at` (the subset AMDGPU metadata uses)."""
    b = data[at]
    if b <= 0x7F:
        return b, at + 1
    if b >= 0xE0:
        return b - 0x100, at + 1
    if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
        n, at = (b & 0x0F, at + 1) if b <= 0x8F else ((struct.unpack_from(">H", data, at + 1)[0], at + 3) if b == 0xDE
                                                      else (struct.unpack_from(">I", data, at + 1)[0], at + 5))
        out = {}
        for _ in range(n):
            k, at = _msgpack(data, at)
            out[k], at = _msgpack(data, at)
        return out, at
    if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
        n, at = (b & 0x0F, at + 1) if b <= 0x9F else ((struct.unpack_from(">H", data, at + 1)[0], at + 3) if b == 0xDC
                                                      else (struct.unpack_from(">I", data, at + 1)[0], at + 5))
        out = []
        for _ in range(n):
            v, at = _msgpack(data, at)
            out.append(v)
        return out, at
    if 0xA0 <= b <= 0xBF or b in (0xD9, 0xDA, 0xDB):
        n, at = (b & 0x1F, at + 1) if b <= 0xBF else {0xD9: (data[at + 1], at + 2),
                                                      0xDA: (struct.unpack_from(">H", data, at + 1)[0], at + 3),
                                                      0xDB: (struct.unpack_from(">I", data, at + 1)[0], at + 5)}[b]
        return data[at:at + n].decode(), at + n
    fixed = {0xC0: (None, 0), 0xC2: (False, 0), 0xC3: (True, 0)}
    if b in fixed:
        return fixed[b][0], at + 1
    ints = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q",
            0xCA: ">f", 0xCB: ">d"}
    if b in ints:
        v, = struct.unpack_from(ints[b], data, at + 1)
        return v, at + 1 + struct.calcsize(ints[b])
    if b in (0xC4, 0xC5, 0xC6):
        n, at = {0xC4: (data[at + 1], at + 2), 0xC5: (struct.unpack_from(">H", data, at + 1)[0], at + 3),
                 0xC6: (struct.unpack_from(">I", data, at + 1)[0], at + 5)}[b]
        return data[at:at + n], at + n
    raise ValueError(f"msgpack: unsupported type byte 0x{b:02x} at {at}")


@dataclasses.dataclass
class KernelInfo:
    """What a code object declares about one kernel (its `.amdhsa` metadata)."""

    name: str
    block: tuple            # reqd_workgroup_size
    args: list              # (offset, size, value kind) of each explicit argument, in order
    kernarg_size: int
    lds_bytes: int          # group_segment_fixed_size (static; IREE's kernels use no dynamic LDS)


def kernels_of(hsaco: bytes) -> dict[str, KernelInfo]:
    """{kernel name: KernelInfo} from the code object's AMDGPU metadata note."""
    meta = [desc for name, kind, desc in _notes(hsaco) if name == "AMDGPU" and kind == _NT_AMDGPU_METADATA]
    if len(meta) != 1:
        raise ValueError(f"hsaco: expected one AMDGPU metadata note, got {len(meta)}")
    doc, _ = _msgpack(meta[0])
    out = {}
    for k in doc["amdhsa.kernels"]:
        args = [(a[".offset"], a[".size"], a[".value_kind"]) for a in k.get(".args", [])
                if not a[".value_kind"].startswith("hidden_")]
        out[k[".name"]] = KernelInfo(k[".name"], tuple(k.get(".reqd_workgroup_size", (k[".max_flat_workgroup_size"], 1, 1))),
                                     args, k[".kernarg_segment_size"], k[".group_segment_fixed_size"])
    return out


def check_kernarg_layout(info: KernelInfo, num_bindings: int, num_constants: int):
    """The launch passes a kernel its bindings (8-byte pointers) then its push constants (4-byte
    values), in that order: refuse a code object that declares anything else."""
    want = [(8 * i, 8, "global_buffer") for i in range(num_bindings)]
    want += [(8 * num_bindings + 4 * i, 4, "by_value") for i in range(num_constants)]
    if info.args != want:
        raise ValueError(f"{info.name}: expected {num_bindings} pointer and {num_constants} 4-byte arguments at "
                         f"{[(o, s, k) for o, s, k in want][:3]}..., got {info.args[:3]}... ({len(info.args)} arguments)")


class HipDriver:
    """The HIP calls a launch needs (libamdhip64 through ctypes; torch made the device current)."""

    _lib = None

    def __init__(self):
        if HipDriver._lib is None:
            HipDriver._lib = ctypes.CDLL("libamdhip64.so")
            HipDriver._lib.hipGetErrorName.restype = ctypes.c_char_p
        self.lib = HipDriver._lib

    def check(self, rc: int, what: str):
        if rc != 0:
            name = self.lib.hipGetErrorName(rc)
            raise RuntimeError(f"{what}: {name.decode() if name else rc}")

    def load(self, hsaco: bytes, names):
        module = ctypes.c_void_p()
        self.check(self.lib.hipModuleLoadData(ctypes.byref(module), ctypes.c_char_p(hsaco)), "hipModuleLoadData")
        functions = {}
        for name in names:
            fn = ctypes.c_void_p()
            self.check(self.lib.hipModuleGetFunction(ctypes.byref(fn), module, name.encode()),
                       f"hipModuleGetFunction {name}")
            functions[name] = fn
        return module, functions


class _HipLaunch:
    """One dispatch: its kernel, grid and a reusable argument block (pointers then constants)."""

    def __init__(self, fn, grid, block, shared, bindings, constants):
        self.fn, self.grid, self.block, self.shared, self.bindings = fn, grid, block, shared, bindings
        self.pointers = [ctypes.c_uint64(0) for _ in bindings]
        self.constants = [ctypes.c_uint32(c) for c in constants]
        slots = self.pointers + self.constants
        self.args = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(s) for s in slots])

    def copy(self):
        return _HipLaunch(self.fn, self.grid, self.block, self.shared, self.bindings, [c.value for c in self.constants])

    def launch(self, lib, stream: int) -> int:
        """Queue it on `stream` (the hipError_t)."""
        return lib.hipModuleLaunchKernel(self.fn, self.grid[0], self.grid[1], self.grid[2], self.block[0],
                                         self.block[1], self.block[2], self.shared, ctypes.c_void_p(stream),
                                         self.args, None)


class HipStreamKernel(PlannedKernel):
    """A gfx942 module's `main`, launched on a given HIP stream (see the module docstring)."""

    def __init__(self, name: str, vmfb: bytes, plan_text: str, driver: HipDriver | None = None):
        self.name = name
        self.hsaco = hsaco_of(vmfb)
        self.kernels = kernels_of(self.hsaco)
        self.plan = DispatchPlan(plan_text)
        self.driver = driver or HipDriver()
        self.module, self.functions = self.driver.load(self.hsaco, self.kernels)
        self._launches = {}

    def _launch(self, name, grid, constants, bindings):
        info = self.kernels[name]
        check_kernarg_layout(info, len(bindings), len(constants))
        return _HipLaunch(self.functions[name], grid, info.block, 0, bindings, constants)
