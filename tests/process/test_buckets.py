"""The bucket plan of a real preset: qwen3_1p7b's embedding gets a bucket of its own at 512 MiB
(tests/unit/test_buckets.py: the plan's rules on small tensors)."""

import torch

from rlsync.update.buckets import plan_buckets

BF16 = torch.bfloat16


def test_qwen3_1p7b_embedding_is_its_own_bucket_at_512_mib(compose):
    from transformers import Qwen3ForCausalLM

    from rlsync.model.build import hf_config, named_weights
    from rlsync.update.buckets import metas_of

    with torch.device("meta"):
        model = Qwen3ForCausalLM(hf_config(compose("model=qwen3_1p7b").model))
    buckets = plan_buckets(metas_of(named_weights(model), BF16), 512 * 2**20)
    embed = next(b for b in buckets if "model.embed_tokens.weight" in b.names)
    assert embed.names == ["model.embed_tokens.weight"] and embed.nbytes > 512 * 2**20  # ~594 MiB
    assert all(b.nbytes <= 512 * 2**20 for b in buckets if b is not embed)
    assert not any("lm_head" in n for b in buckets for n in b.names)  # tied: sent once
