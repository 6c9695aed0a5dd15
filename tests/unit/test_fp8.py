"""update.payload=fp8: 2-D weights cross in FP8 with a scale per 128x128 block, the engine
holds exactly what the same quantize-dequantize of the trainer's weights gives."""

import pytest
import torch
from conftest import BF16, FAST, check_fp8_reference, read_jsonl, run_main

from rlsync.update.buckets import TensorMeta, plan_buckets
from rlsync.update.payload.fp8 import E4M3_MAX, FP8, dequantize_blocks, layout, quantize_blocks


def test_a_block_is_scaled_by_its_largest_magnitude_over_448():
    x = torch.zeros(130, 260)
    x[0, 0], x[129, 259], x[5, 200] = 896.0, -3.0, 7.0  # blocks (0,0), (1,2), (0,1)
    q, scale = quantize_blocks(x)
    assert q.dtype == FP8 and q.shape == (130, 260) and scale.shape == (2, 3)
    assert scale[0, 0] == 896.0 / E4M3_MAX and scale[1, 2] == 3.0 / E4M3_MAX and scale[0, 1] == 7.0 / E4M3_MAX
    assert scale[1, 0] == 1.0  # an all-zero block: scale 1, values 0
    back = dequantize_blocks(q, scale, torch.float32)
    assert back[0, 0] == 896.0 and back[129, 259] == -3.0 and back[5, 200] == 7.0  # each block's largest is exact
    assert torch.count_nonzero(back) == 3


def test_the_layout_keeps_embeddings_norms_and_small_tensors_in_the_engine_dtype():
    metas = [
        TensorMeta("model.embed_tokens.weight", (512, 64), BF16),
        TensorMeta("model.layers.0.self_attn.q_proj.weight", (256, 64), BF16),
        TensorMeta("model.layers.0.input_layernorm.weight", (64,), BF16),
        TensorMeta("model.layers.0.mlp.down_proj.weight", (16, 32), BF16),  # 512 elements: too small to pay
    ]
    (bucket,) = plan_buckets(metas, 1 << 20)
    parts, nbytes = layout(bucket)
    assert [fp8 for _, fp8, _, _ in parts] == [False, True, False, False]
    q_values = parts[1][2]
    assert q_values == 512 * 64 * 2  # after the embedding's bf16 bytes
    assert parts[1][3] == q_values + 256 * 64  # its one scale (2 x 1 blocks: 2 scales) after its values
    assert nbytes == 512 * 64 * 2 + 256 * 64 + 2 * 4 + 64 * 2 + 512 * 2
    assert nbytes < bucket.nbytes


def test_the_engine_holds_the_reference_quantization(tiny, eager_kernels):
    """Through the update's eager chunks: the compiled kernels are checked against the same reference by
    tests/unit/test_payload_kernels.py, and through the update over the engine processes by tests/process/test_fp8.py."""
    check_fp8_reference(tiny, "direct")


def test_qwen3_0p6b_crosses_in_under_two_thirds_of_its_bf16_bytes(compose):
    """Its tied 151936 x 1024 embedding (26 % of the elements) stays bf16, as FP8 checkpoints keep it."""
    from rlsync.model.architecture import update_shapes

    metas = [TensorMeta(n, tuple(s), BF16) for n, s in update_shapes(compose("model=qwen3_0p6b").model)]
    buckets = plan_buckets(metas, 512 << 20)
    ratio = sum(layout(b)[1] for b in buckets) / sum(b.nbytes for b in buckets)
    assert 0.55 < ratio < 0.67, ratio


def test_a_run_in_fp8_verifies_every_step_and_reports_the_logprob_gap(tmp_path, eager_kernels):
    proc = run_main(*FAST, "update.payload=fp8", "update.verify=true", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert all(r["perf/update_weights_bytes"] < r["perf/update_weights_full_bytes"] for r in rows)
    assert all(r["train/logprob_abs_diff"] > 0 for r in rows)


@pytest.mark.parametrize(
    "overrides, key",
    [(["update.wire_dtype=float8_e4m3fn"], "update.wire_dtype"), (["update.strategy=per_tensor"], "update.strategy")],
)
def test_what_fp8_cannot_go_with_is_refused_in_one_line(tmp_path, overrides, key):
    proc = run_main("update.payload=fp8", *overrides, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"rlsync: config error: {key}="), line
