"""Read the gfx942 ISA IREE dumped for each kernel: registers, spills, LDS, MFMA, loads, dispatches.

Occupancy model (CDNA3): 512 VGPR+AGPR per lane per SIMD in granules of 8, at most 8 waves per
SIMD; LDS 64 KiB per CU shared by the workgroups on it.
"""
from __future__ import annotations

import json
import pathlib
import re
from collections import Counter

INSTRUCTIONS = {
    "mfma": r"v_mfma\w*",
    "cvt_fp8": r"v_cvt\w*(?:fp8|bf8)\w*",
    "global_load": r"(?:global|buffer|flat)_load\w*",
    "global_load_x4": r"(?:global|buffer|flat)_load_dwordx4",
    "global_load_x2": r"(?:global|buffer|flat)_load_dwordx2",
    "global_store": r"(?:global|buffer|flat)_store\w*",
    "scratch_ops": r"scratch_\w+",
    "ds_ops": r"ds_\w+",
}


def _kernels(text: str):
    for m in re.finditer(r"\.amdhsa_kernel (\S+)(.*?)\.end_amdhsa_kernel", text, re.S):
        yield m.group(1), dict(re.findall(r"\.amdhsa_(\w+)\s+(\S+)", m.group(2)))


def _body(text: str, name: str) -> str:
    """The function's instructions: from its label to its .Lfunc_end (an early s_endpgm may come first)."""
    m = re.search(rf"^{re.escape(name)}:\s*$(.*?)^\.Lfunc_end\d+:", text, re.S | re.M)
    return m.group(1) if m else ""


def _workgroup_sizes(text: str) -> dict:
    """Kernel name -> its workgroup size, from the amdgpu metadata (.max_flat_workgroup_size)."""
    return {m.group(2): int(m.group(1)) for m in
            re.finditer(r"\.max_flat_workgroup_size:\s+(\d+)\s+\.name:\s+(\S+)", text)}


def waves_per_simd(total_regs: int, lds_bytes: int, workgroup_size: int) -> int:
    """Waves a SIMD can hold: by registers (512 a lane, 8 at most) and by LDS (64 KiB a CU of 4
    SIMDs, shared by whole workgroups of workgroup_size / 64 waves)."""
    by_regs = min(8, 512 // max(total_regs, 1))
    if not lds_bytes:
        return by_regs
    waves_per_wg = -(-workgroup_size // 64)
    return min(by_regs, (65536 // lds_bytes) * waves_per_wg // 4)


def isa_stats(isa_text: str) -> list[dict]:
    rows = []
    wg_sizes = _workgroup_sizes(isa_text)
    for name, d in _kernels(isa_text):
        body = _body(isa_text, name)
        ops = Counter()
        for line in body.splitlines():
            op = line.strip().split(" ")[0]
            for key, pat in INSTRUCTIONS.items():
                if re.fullmatch(pat, op):
                    ops[key] += 1
        vgpr = int(d.get("next_free_vgpr", 0))
        agpr_off = int(d.get("accum_offset", vgpr) or vgpr)
        arch_vgpr = min(vgpr, agpr_off) if agpr_off else vgpr
        total = -(-vgpr // 8) * 8 if vgpr else 8
        lds = int(d.get("group_segment_fixed_size", 0))
        waves = waves_per_simd(total, lds, wg_sizes.get(name, 256))
        rows.append({"function": name, "vgpr": arch_vgpr, "agpr": max(0, vgpr - agpr_off),
                     "sgpr": int(d.get("next_free_sgpr", 0)), "scratch_bytes": int(d.get("private_segment_fixed_size", 0)),
                     "lds_bytes": lds, "waves_per_simd": waves, **{
                         k: ops.get(k, 0) for k in INSTRUCTIONS}})
    return rows


def kernel_report(build_dir) -> list[dict]:
    """Per kernel of a gfx942 build: its dispatches (one ISA function each) and their stats."""
    build_dir = pathlib.Path(build_dir)
    manifest = json.loads((build_dir / "manifest.json").read_text())
    if manifest.get("target") != "gfx942":
        raise ValueError(f"{build_dir}: expected a gfx942 build, got target {manifest.get('target')!r}")
    report = []
    for name in sorted(manifest["kernels"]):
        isa_dir = build_dir / "isa" / name
        dispatches = []
        for f in sorted(isa_dir.glob("*.rocmasm")):
            dispatches += isa_stats(f.read_text())
        report.append({"kernel": name, "dispatches": len(dispatches), "functions": dispatches})
    return report


COLUMNS = ("vgpr", "agpr", "scratch_bytes", "lds_bytes", "waves_per_simd", "mfma", "cvt_fp8", "global_load",
           "global_load_x4")


def _aggregate(k) -> dict:
    """A kernel's row: the worst dispatch for resources, the lowest occupancy, summed instruction counts."""
    fs = k["functions"]
    return {c: (max if c in ("vgpr", "agpr", "scratch_bytes", "lds_bytes") else min if c == "waves_per_simd" else sum)(
        f[c] for f in fs) for c in COLUMNS}


def format_report(report) -> str:
    width = max([len("kernel")] + [len(k["kernel"]) for k in report])
    head = f"{'kernel':{width}} {'disp':>4} " + " ".join(f"{c[:9]:>9}" for c in COLUMNS)
    lines = [head, "-" * len(head)]
    for k in report:
        if not k["functions"]:
            lines.append(f"{k['kernel']:{width}} {'?':>4}  (no ISA dump: rebuild with msa-iree compile --target gfx942)")
            continue
        agg = _aggregate(k)
        lines.append(f"{k['kernel']:{width}} {k['dispatches']:>4} " + " ".join(f"{agg[c]:>9}" for c in COLUMNS))
    lines.append("vgpr/agpr/scratch/lds: worst dispatch; waves: lowest; instruction counts: summed over dispatches.")
    return "\n".join(lines)


def summary(report) -> str:
    """A few lines: how many kernels, whether any spills, and the served GPU kernels' headline
    resources (the full table: format_report, `msa-iree inspect`)."""
    dumped = [k for k in report if k["functions"]]
    spilling = [k["kernel"] for k in dumped if _aggregate(k)["scratch_bytes"]]
    lines = [f"{len(report)} kernels, {sum(k['dispatches'] for k in dumped)} dispatches; "
             f"{len(spilling)} with scratch (register spills){': ' + ', '.join(spilling) if spilling else ''}"]
    for k in dumped:
        kernel = k["kernel"].split(".")[0]
        if kernel in ("sparse_attn_decode_mfma", "sparse_attn_prefill_mfma", "insert_kv_gpu") and ".s16" in k["kernel"] \
                and (".L1." in k["kernel"] or "decode" not in kernel):
            a = _aggregate(k)
            lines.append(f"  {kernel} (interleaved cache{', L=1' if 'decode' in kernel else ''}): {k['dispatches']} "
                         f"dispatches, {a['vgpr']} VGPR, {a['agpr']} AGPR, {a['scratch_bytes']} B scratch, "
                         f"{a['waves_per_simd']} waves/SIMD, {a['mfma']} MFMA, {a['global_load_x4']} 16-byte loads")
    lines.append("full table: msa-iree inspect <build dir>")
    return "\n".join(lines)
