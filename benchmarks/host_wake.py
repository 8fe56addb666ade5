"""What a wait costs the host's next work: `MetadataBuilder.build` of a step (decode B=64 at 4K,
and a mixed step: a 2K-token prefill chunk after 63 decodes at 4K) and, beside it, a fixed
numpy loop, each timed back to back and right after the host slept or spun for each wait.

A serving host waits for the GPU every step (vLLM: for the sampled tokens), then builds the next
step's metadata. A CPU idle for milliseconds runs its next few hundred microseconds of work
slower, so a build timed in a loop of builds understates what a step pays after its kernels.
The builder here has no kernel library (kernels=None: the portable writer's slot form).

    python -m benchmarks.host_wake                    # the builder on the host CPU (no GPU needed)
    python -m benchmarks.host_wake --device cuda      # on CUDA: the driver's copies, synced
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from msa_iree.runtime import MetadataBuilder

BATCH, CONTEXT, CHUNK = 64, 4096, 2048


def step_inputs(device, chunk: int, seed: int = 0):
    """(block_table, seq_lens, query_start_loc, num_computed_tokens, slot_mapping, num_decodes) of a
    step of BATCH requests at CONTEXT tokens: all decodes, or the last request a prefill chunk."""
    g = torch.Generator().manual_seed(seed)
    cols = CONTEXT // 128
    table = torch.randperm(2 * BATCH * cols, generator=g)[:BATCH * cols].int().view(BATCH, cols)
    qlens = torch.ones(BATCH, dtype=torch.int32)
    if chunk:
        qlens[-1] = chunk
    seq = torch.full((BATCH,), CONTEXT, dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), qlens.cumsum(0).int()])
    computed = seq - qlens
    req = torch.repeat_interleave(torch.arange(BATCH), qlens)
    pos = torch.cat([torch.arange(int(c), int(s)) for c, s in zip(computed, seq)])
    slots = (table[req, pos // 128].long() * 128 + pos % 128).int()
    tensors = tuple(t.to(device) for t in (table, seq, qsl, computed, slots))
    return (*tensors, BATCH - 1 if chunk else BATCH)


def builder_call(device, chunk):
    """A function that builds the step (and waits for the device's copies)."""
    table, seq, qsl, computed, slots, num_decodes = step_inputs(device, chunk)
    builder = MetadataBuilder(BATCH, CONTEXT, max_num_tokens=int(qsl[-1]), num_cache_blocks=2 * table.numel(),
                              device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def build():
        builder.build(table, seq, qsl, computed, 1, num_decodes, slot_mapping=slots, max_seq_len=CONTEXT)
        sync()
    return build


def numpy_call():
    a = np.arange(4096, dtype=np.int64)

    def loop():
        for _ in range(20):
            np.add(a, 1, out=a)
    return loop


def after_wait_us(fn, wait_s: float, spin: bool, reps: int) -> float:
    """Median us of fn() right after the host slept (or spun) wait_s, over reps calls."""
    times = []
    for _ in range(reps):
        if wait_s and spin:
            t = time.perf_counter()
            while time.perf_counter() - t < wait_s:
                pass
        elif wait_s:
            time.sleep(wait_s)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_wake", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="where the builder's tensors live: cpu or cuda")
    p.add_argument("--waits", default="0,1,5,15", help="waits before each call, ms")
    p.add_argument("--reps", type=int, default=200, help="calls timed per cell")
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    waits = [float(w) for w in args.waits.split(",")]
    work = {"build decode": builder_call(device, 0), "build mixed": builder_call(device, CHUNK),
            "numpy loop": numpy_call()}
    rows = []
    for name, fn in work.items():
        for _ in range(20):
            fn()
        for spin in (False, True):
            cells = {w: after_wait_us(fn, w / 1e3, spin, args.reps) for w in waits if spin is False or w}
            rows.append({"work": name, "wait": "spin" if spin else "sleep", "us_after_ms": cells})
    print(f"median us of each call right after the host waited (ms); device {device}, {args.reps} calls a cell")
    print(f"{'work':>13} {'wait':>5} " + " ".join(f"{w:>8g}" for w in waits))
    for r in rows:
        cells = " ".join(f"{r['us_after_ms'][w]:8.1f}" if w in r["us_after_ms"] else f"{'-':>8}" for w in waits)
        print(f"{r['work']:>13} {r['wait']:>5} {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "reps": args.reps, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
