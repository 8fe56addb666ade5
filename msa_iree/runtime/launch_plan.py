"""What the stream launchers share (runtime/cuda_launch.py, runtime/hip_launch.py): `main` as IREE
lowered it to HAL (`--compile-to=hal`, saved by the build as the kernel's launch plan), interpreted
for given operand shapes into each dispatch's grid, push constants and bindings, and a launch bound
to fixed operands.

`DispatchPlan` interprets the subset of ops `main` uses and raises on any other, so a new IREE
version that lowers differently fails loudly; the GPU tests compare stream-launched kernels with
IREE's own call of them, byte for byte.
"""
from __future__ import annotations

import re

_BINARY = {"muli": lambda a, b: a * b, "addi": lambda a, b: a + b, "subi": lambda a, b: a - b,
           "divui": lambda a, b: a // b, "ceildivui": lambda a, b: -(-a // b), "remui": lambda a, b: a % b,
           "andi": lambda a, b: a & b,
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


# IREE compiles a kernel taking its bindings 16-byte aligned (the pointers' `align 16`), and may
# load neighbouring elements as one vector: an operand elsewhere faults (CUDA: misaligned address)
BINDING_ALIGNMENT = 16


def check_alignment(name, operand, address: int):
    if address % BINDING_ALIGNMENT:
        raise ValueError(f"{name}: expected operand {operand} at a {BINDING_ALIGNMENT}-byte aligned address (the "
                         f"compiled kernels take their bindings aligned), got {address:#x}; pass a contiguous copy")


def queue(driver, name, launches, stream: int):
    """Queue `launches` (their argument blocks written) on `stream`, in order; a failed launch raises."""
    lib = driver.lib
    for d in launches:
        rc = d.launch(lib, stream)
        if rc:
            driver.check(rc, f"{name}: launch")



class PlannedKernel:
    """A module's `main` launched on a stream from its launch plan: what the CUDA and HIP stream
    kernels share. A subclass sets `name`, `driver` and `plan` and builds one dispatch's launch
    (`_launch`: it checks the kernel takes what the plan passes)."""

    def _launch(self, name, grid, constants, bindings):
        raise NotImplementedError

    def _dispatches(self, tensors):
        """The dispatches of `main` for these operands' shapes and dtypes, worked out once and reused."""
        key = tuple((t.shape, t.dtype) for t in tensors)
        launches = self._launches.get(key)
        if launches is None:
            shapes = [tuple(t.shape) for t in tensors]
            dtypes = [str(t.dtype).replace("torch.", "") for t in tensors]
            launches = self._launches[key] = [self._launch(*d) for d in self.plan.evaluate(shapes, dtypes)]
        return launches

    def __call__(self, tensors, stream: int):
        """Queue `main` on `stream` (a CUstream / hipStream_t handle) over contiguous device tensors
        in `main`'s operand order."""
        launches = self._dispatches(tensors)
        for d in launches:
            for slot, (k, offset) in zip(d.pointers, d.bindings):
                slot.value = tensors[k].data_ptr() + offset
                check_alignment(self.name, k, slot.value)
        queue(self.driver, self.name, launches, stream)

    def bind(self, tensors, variable):
        """`main` over these operands, of which those at the indices `variable` may move between
        calls: a BoundLaunch (the plan evaluated and every other pointer written once)."""
        return BoundLaunch(self, tensors, variable)


class BoundLaunch:
    """A stream kernel's (StreamKernel, HipStreamKernel) dispatches over operands fixed but for a
    few (`variable`) whose addresses are given per call: a call writes those addresses and queues
    the kernels, nothing else (the per-call host cost of a layer's attend, benchmarks/PERF.md). It
    keeps the fixed operands alive; the caller checks that the variable ones have the shapes and
    dtypes it was bound with."""

    def __init__(self, sk, tensors, variable):
        self.name, self._driver = sk.name, sk.driver
        self._keep = list(tensors)
        self._launches = [d.copy() for d in sk._dispatches(tensors)]  # argument blocks of its own
        self._moving = []  # (pointer slot, index into the call's addresses, byte offset)
        for d in self._launches:
            for slot, (k, offset) in zip(d.pointers, d.bindings):
                slot.value = tensors[k].data_ptr() + offset
                check_alignment(self.name, k, slot.value)
                if k in variable:
                    self._moving.append((slot, variable.index(k), offset))

    def __call__(self, stream: int, *addresses):
        """Queue the kernels on `stream` with the variable operands at `addresses` (data_ptr()s, in
        the order of `variable`)."""
        for slot, i, offset in self._moving:
            slot.value = address = addresses[i] + offset
            if address % BINDING_ALIGNMENT:
                check_alignment(self.name, f"at address index {i}", address)
        queue(self._driver, self.name, self._launches, stream)
