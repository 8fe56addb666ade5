"""Lower kernels to vmfb modules: export (iree-turbine) -> MLIR -> iree.compiler, per target.

`build()` writes one vmfb per kernel variant plus `manifest.json` into an output directory,
atomically (temp file + rename, manifest last), skipping kernels whose content key (the kernel
sources, the spec, the flags and the tool versions) is unchanged. A shared content-addressed
cache (`MSA_IREE_CACHE`, default ~/.cache/msa-iree) lets tests and builds reuse modules.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import re
import tempfile
import time
from importlib import metadata

from . import __version__

TARGETS: dict[str, list[str]] = {
    "host": ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
             "--iree-llvmcpu-target-cpu=host"],
    "gfx942": ["--iree-hal-target-device=hip", "--iree-rocm-target=gfx942"],
    "cuda": ["--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80"],
}
# The IREE runtime driver that runs each target's modules.
DRIVERS = {"host": "local-task", "gfx942": "hip", "cuda": "cuda"}
# Where each target's modules can be run and therefore verified.
VERIFIED_ON = {"host": "tested on the host CPU by the test suite",
               "cuda": "runs on NVIDIA GPUs (sm_80 PTX, JIT on newer; the e4m3fn mma attend sm_89+); benchmarked on an H200",
               "gfx942": "compiled and inspected only: no AMD GPU was available to run it"}
# what a compiled module depends on besides its spec: the kernels (ops/, its templates) and the modules they read
_SOURCES = ("ops/*.py", "ops/templates/*.j2", "layout.py", "config.py", "compile.py")


class CompileError(RuntimeError):
    """iree-compile failed, or a kernel was asked of a target it is not built for."""


class BuildMismatchError(RuntimeError):
    """A build directory that does not belong to this runtime (version, target, checksum, kernel)."""


@functools.cache
def iree_version() -> str:
    return metadata.version("iree-base-compiler")


def runtime_version() -> str:
    return metadata.version("iree-base-runtime")


def check_target(target: str) -> str:
    if target not in TARGETS:
        raise ValueError(f"target: expected one of {sorted(TARGETS)}, got {target!r}")
    return target


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("MSA_IREE_CACHE", pathlib.Path.home() / ".cache" / "msa-iree"))


@functools.cache
def _source_digest() -> str:
    here = pathlib.Path(__file__).parent
    files = sorted(f for pattern in _SOURCES for f in here.glob(pattern))
    if not any(f.suffix == ".j2" for f in files):
        raise CompileError(f"{here / 'ops' / 'templates'}: expected the kernel templates (package data), found none; "
                           "this installation of msa-iree is incomplete")
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(here).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


@functools.cache
def _tool_versions() -> dict:
    return {"iree": iree_version(), "torch": metadata.version("torch"), "turbine": metadata.version("iree-turbine")}


def content_key(spec, target: str, extra_flags=()) -> str:
    flags = TARGETS[target] + spec.target_flags(target) + list(extra_flags)
    payload = json.dumps({"spec": spec.describe(), "name": spec.name, "flags": flags,
                          **_tool_versions(), "sources": _source_digest()},
                         sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def export_mlir(spec) -> str:
    """The kernel's MLIR: its rendered template (hand-written kernels) or its torch formulation
    traced by iree-turbine (torch dialect, dynamic dims symbolic)."""
    if hasattr(spec, "render"):
        return spec.render()
    import warnings

    import iree.turbine.aot as aot

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = aot.export(spec.module(), args=spec.example_args(), dynamic_shapes=spec.dynamic_shapes(),
                              strict_export=False)
    return str(exported.mlir_module)


def compile_mlir(mlir: str, target: str, extra_flags=()) -> bytes:
    import iree.compiler as ic

    try:
        return ic.compile_str(mlir, input_type="auto", extra_args=TARGETS[target] + list(extra_flags))
    except ic.CompilerToolError as e:
        raise CompileError(f"iree-compile failed for target {target}: {str(e)[:4000]}") from None


def _atomic_write(path: pathlib.Path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _cached_paths(spec, target: str, key: str):
    stem = cache_dir() / target / f"{spec.name}.{key[:16]}"
    return pathlib.Path(f"{stem}.vmfb"), pathlib.Path(f"{stem}.isa")


def is_cached(spec, target: str, extra_flags=()) -> bool:
    """Whether the content cache holds `spec`'s module for `target` (compiled_module would not compile)."""
    return _cached_paths(spec, target, content_key(spec, target, extra_flags))[0].exists()


def compiled_module(spec, target: str, extra_flags=(), mlir_dir=None, isa_dir=None, key=None):
    """(vmfb bytes, content key, cache_hit) through the shared content-addressed cache.

    mlir_dir: also write the kernel's MLIR there. isa_dir: also put the executables' dumped files
    there (sources, .ll, .rocmasm / .ptx, binaries), cached beside the vmfb like it, so that a build
    into any output directory reuses both. key: content_key(spec, target, extra_flags), when the
    caller has it already.
    """
    import shutil

    supported = getattr(spec, "targets", None)
    if supported is not None and target not in supported:
        raise CompileError(f"{spec.name}: expected a target in {list(supported)}, got {target!r} "
                           "(a GPU-level kernel: llvm-cpu cannot lower gpu.thread_id)")
    key = key or content_key(spec, target, extra_flags)
    cached, cached_isa = _cached_paths(spec, target, key)
    mlir = export_mlir(spec) if mlir_dir is not None else None
    if mlir is not None:
        _atomic_write(pathlib.Path(mlir_dir) / f"{spec.name}.mlir", mlir.encode())
    hit = cached.exists() and (isa_dir is None or cached_isa.is_dir())
    if hit:
        vmfb = cached.read_bytes()
    else:
        cached.parent.mkdir(parents=True, exist_ok=True)
        dump, fresh_isa = [], None
        if isa_dir is not None:
            fresh_isa = tempfile.mkdtemp(dir=cached.parent, prefix=".isa.")
            # sources, intermediates (.ll, .rocmasm, .ptx) and binaries; not the meta flag
            # (--iree-hal-dump-executable-files-to), which also asks for benchmarks and makes IREE
            # print a remark for every hand-written executable it cannot make one of
            dump = [f"--iree-hal-dump-executable-{what}-to={fresh_isa}" for what in ("sources", "intermediates", "binaries")]
        try:
            vmfb = compile_mlir(mlir or export_mlir(spec), target, spec.target_flags(target) + list(extra_flags) + dump)
            if fresh_isa is not None:
                shutil.rmtree(cached_isa, ignore_errors=True)
                os.replace(fresh_isa, cached_isa)
        finally:
            if fresh_isa is not None:
                shutil.rmtree(fresh_isa, ignore_errors=True)
        _atomic_write(cached, vmfb)
    if isa_dir is not None:
        shutil.rmtree(isa_dir, ignore_errors=True)
        shutil.copytree(cached_isa, isa_dir)
    return vmfb, key, hit


def launch_plan(spec, target: str, extra_flags=(), key=None):
    """`main` lowered to HAL, from which the runtime's stream launchers launch the kernel on
    torch's stream: for the GPU-level kernels that write only into their operands
    (`spec.written_operands`), else None. key: as compiled_module's."""
    if not _launchable(spec, target):
        return None
    key = key or content_key(spec, target, extra_flags)
    cached = cache_dir() / target / f"{spec.name}.{key[:16]}.main-hal.mlir"
    if cached.exists():
        return cached.read_text()
    text = compile_mlir(export_mlir(spec), target, spec.target_flags(target) + list(extra_flags) + ["--compile-to=hal"])
    main = hal_main(text.decode() if isinstance(text, bytes) else text)
    _atomic_write(cached, main.encode())
    return main


def hal_main(hal_text: str) -> str:
    """`main` of a module compiled with `--compile-to=hal` (what the build saves)."""
    m = re.search(r"^  util\.func public @main\(.*?^  \}", hal_text, re.S | re.M)
    if m is None:
        raise ValueError("hal_text: expected a module with `util.func public @main`, got none")
    return re.sub(r"\s+loc\(.*$", "", m.group(0), flags=re.M)


def _launchable(spec, target: str) -> bool:
    """Whether a build of `spec` for `target` carries a launch plan (the in-place GPU kernels)."""
    return target in ("cuda", "gfx942") and bool(getattr(spec, "written_operands", None))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _intact(out: pathlib.Path, entry: dict) -> bool:
    """The manifest entry's vmfb (and launch plan, if it has one) exist in `out` with the
    recorded sha256."""
    files = [entry] + ([entry["launch_plan"]] if "launch_plan" in entry else [])
    return all((out / f["file"]).exists() and sha256((out / f["file"]).read_bytes()) == f["sha256"] for f in files)


def build(cfg, targets, out_root=None, *, strides=(16, 8), decode_query_lens=(1, 2, 3, 4), emit_mlir=False,
          extra_flags=(), log=print, specs=None, request_key=None) -> dict[str, pathlib.Path]:
    """Build the kernel set of `cfg` for each target into `out_root/<target>` (or `build/<target>`).

    Returns {target: manifest path}. Progress goes through `log`, one line per kernel.
    """
    results = {}
    for target in targets:
        check_target(target)
        out = pathlib.Path("build") / target if out_root is None else \
            pathlib.Path(out_root) / target if len(targets) > 1 else pathlib.Path(out_root)
        out.mkdir(parents=True, exist_ok=True)
        manifest_path = out / "manifest.json"
        old = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
        old_kernels = old.get("kernels", {})
        kernels = {}
        from .ops import kernel_set

        todo = specs if specs is not None else kernel_set(cfg, strides, decode_query_lens, target)
        for i, spec in enumerate(todo, 1):
            t0 = time.perf_counter()
            key = content_key(spec, target, extra_flags)
            vmfb_path = out / f"{spec.name}.vmfb"
            entry = old_kernels.get(spec.name)
            isa_ok = target != "gfx942" or (out / "isa" / spec.name).is_dir()
            plan_ok = not _launchable(spec, target) or "launch_plan" in (entry or {})
            if entry and entry["content_key"] == key and not emit_mlir and isa_ok and plan_ok and _intact(out, entry):
                kernels[spec.name] = entry
                log(f"[{target} {i}/{len(todo)}] {spec.name}: up to date")
                continue
            isa_dir = out / "isa" / spec.name if target == "gfx942" else None
            vmfb, key, hit = compiled_module(spec, target, extra_flags, mlir_dir=out / "mlir" if emit_mlir else None,
                                             isa_dir=isa_dir, key=key)
            _atomic_write(vmfb_path, vmfb)
            kernels[spec.name] = {"file": vmfb_path.name, "sha256": sha256(vmfb), "content_key": key,
                                  **spec.describe()}
            plan = launch_plan(spec, target, extra_flags, key=key)
            if plan is not None:  # msa_iree.launch: the kernel on torch's stream
                plan_path = out / f"{spec.name}.main-hal.mlir"
                _atomic_write(plan_path, plan.encode())
                kernels[spec.name]["launch_plan"] = {"file": plan_path.name, "sha256": sha256(plan.encode())}
            log(f"[{target} {i}/{len(todo)}] {spec.name}: {'cached' if hit else 'compiled'} "
                f"({len(vmfb) // 1024} KiB, {time.perf_counter() - t0:.1f} s)")
        manifest = {"msa_iree_version": __version__, "request_key": request_key,
                    "iree_compiler_version": iree_version(), "target": target, "driver": DRIVERS[target], "flags": TARGETS[target] + list(extra_flags),
                    "verified": VERIFIED_ON[target], "config": cfg.__dict__ if cfg else None,
                    "shapes": {"dynamic": "tokens, requests, table columns, cache pages, scale slots",
                               "static": "heads per rank, head_dim 128, block 128, page 16, top-k, decode L"},
                    "kernels": {**{k: v for k, v in old_kernels.items() if k not in kernels and (out / v["file"]).exists()},
                                **kernels}}
        _atomic_write(manifest_path, json.dumps(manifest, indent=1, sort_keys=True, default=str).encode())
        results[target] = manifest_path
    return results


def request_key(options: dict, target: str) -> str:
    """Key of one `msa-iree compile` request: its options, the kernel sources and tool versions.

    Computable without importing torch, so that a rebuild with nothing changed returns at once.
    """
    payload = json.dumps({"options": options, "target": target, "flags": TARGETS[target], "sources": _source_digest(),
                          **_tool_versions()},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def up_to_date(out: pathlib.Path, key: str) -> bool:
    """True when `out` holds a manifest for the same request whose every vmfb matches its sha256."""
    path = pathlib.Path(out) / "manifest.json"
    if not path.exists():
        return False
    m = json.loads(path.read_text())
    if m.get("request_key") != key:
        return False
    if not all(_intact(path.parent, entry) for entry in m["kernels"].values()):
        return False
    return not m.get("target") == "gfx942" or (path.parent / "isa").is_dir()
