"""The serving-step benchmark's cases on the CPU (the timing itself needs a CUDA device): a
step's metadata, inserts and attends over the layers' own caches give the reference's output,
for a decode step and a mixed step (a prefill chunk after the decodes)."""
import pytest
import torch

from benchmarks import bench
from benchmarks.serving_step import ServingCase
from msa_iree import reference
from msa_iree.layout import unpack_kv_cache
from tolerances import assert_attend_close


@pytest.mark.parametrize("chunk, insert, max_model_len", [(0, "forward", None), (0, "separate", None),
                                                          (200, "forward", None), (200, "forward", 4096)])
def test_a_step_of_the_layers_attends_as_the_reference(host_kernels, monkeypatch, chunk, insert, max_model_len):
    monkeypatch.setattr(bench, "POOL_BYTES", 1 << 20)
    case = ServingCase(host_kernels, torch.device("cpu"), batch=3, context=300, num_heads=16, kv_name="bf16",
                       prefill_chunk=chunk, pool_gib=1 / 64, layers=2, insert=insert, max_model_len=max_model_len)
    assert case.step_tensors[0][0].shape == (3, 32 if max_model_len else 3)  # the block table's columns
    tokens = 2 + chunk if chunk else 3
    assert case.q.shape[0] == tokens and case.topk.shape == (1, tokens, 16) and case.slots.shape == (tokens,)
    md = case.build()
    case.layers_call(md)
    c = case.case
    for attn, k, v, out in case.layers:
        # the step's new K/V are in this layer's cache at the step's slots ...
        k_logical, _ = unpack_kv_cache(k, v)
        slots = case.slots.long()
        assert torch.equal(k_logical.reshape(-1, 128)[slots], case.key[:, 0])
        # ... and the layer's output is the reference attend over that cache
        req = torch.repeat_interleave(torch.arange(3), (case.qsl[1:] - case.qsl[:-1]).long())
        pos = torch.cat([torch.arange(int(n)) + int(s) for n, s in zip(case.qsl[1:] - case.qsl[:-1], case.computed)])
        bt, ctx = reference.build_sparse_block_table_prefill(case.topk, c.block_table, req.int(), pos.int(), 16)
        ref = torch.empty_like(case.q)
        reference.sparse_paged_attend(case.q, k, v, bt, ctx, 1, attn.scale, ref)
        assert_attend_close(out, ref, f"chunk {chunk}")
    assert case.layers[0][1].data_ptr() != case.layers[1][1].data_ptr()  # each layer its own cache


def test_a_cases_measurement_runs_end_to_end_on_the_host(host_kernels, monkeypatch):
    """measure() (its CUDA syncs made no-ops, no graph): every timing is taken, each a duration."""
    from benchmarks import serving_step

    monkeypatch.setattr(bench, "POOL_BYTES", 1 << 20)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(serving_step, "STEPS", 3)
    case = ServingCase(host_kernels, torch.device("cpu"), batch=3, context=300, num_heads=16, kv_name="bf16",
                       pool_gib=1 / 64, layers=2)
    row = serving_step.measure(case, graph=False)
    assert set(row) == {"build_us", "build_alone_us", "build_idle_us", "idle_ms", "host_us", "eager_us"}
    assert all(v > 0 for v in row.values())


def test_cpu_pins_the_process_and_a_cpu_it_may_not_use_is_refused(capsys):
    import os

    from benchmarks import serving_step

    before = os.sched_getaffinity(0)
    cpu = max(before)
    try:
        serving_step.pin_to_cpu(cpu)
        assert os.sched_getaffinity(0) == {cpu}
    finally:
        os.sched_setaffinity(0, before)
    with pytest.raises(SystemExit):
        serving_step.main(["--build-dir", "unused", "--cpu", str(max(before) + 4096)])
    err = capsys.readouterr().err
    assert "--cpu: expected one of the CPUs this process may run on" in err and str(max(before) + 4096) in err
    assert os.sched_getaffinity(0) == before
