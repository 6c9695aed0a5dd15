"""The standalone engine's typed messages (rlsync/client/messages.py): tensors by value, the plan, and
what a message that does not add up is refused with. No processes: the wire's own logic."""

from __future__ import annotations

import pytest
import torch
from conftest import Tiny
from pydantic import ValidationError

from rlsync.client.messages import (
    VOCAB_SIZE,
    WIRE_DTYPES,
    GenerateRequest,
    Plan,
    TensorData,
    WireError,
    decode_result,
    encode_result,
    request_args,
    request_body,
)
from rlsync.client.stream import StreamRequest
from rlsync.config.schema import UpdateConfig
from rlsync.serve.app import received_buckets
from rlsync.update import plan_for
from rlsync.update.broadcast import BroadcastReceiver


@pytest.mark.parametrize("dtype", list(WIRE_DTYPES.values()), ids=list(WIRE_DTYPES))
def test_a_tensor_crosses_by_value_bit_for_bit(dtype):
    source = (torch.randn(3, 5, dtype=torch.float64) * 100).to(dtype)
    back = TensorData.model_validate_json(TensorData.of(source).model_dump_json()).tensor()
    assert back.dtype == dtype and back.shape == source.shape
    assert torch.equal(back.view(torch.uint8), source.contiguous().view(torch.uint8))


def test_a_tensor_whose_bytes_do_not_match_its_shape_is_refused():
    data = TensorData.of(torch.zeros(4, dtype=torch.float32)).model_copy(update={"shape": [5]})
    with pytest.raises(WireError, match="needs 20 bytes, got 16"):
        data.tensor()
    with pytest.raises(ValidationError):
        TensorData(dtype="object", shape=[1], data="")  # only the listed dtypes, never a name looked up on torch


def plan_of(update: UpdateConfig) -> tuple[Plan, list]:
    weights = Tiny().weights(seed=0)
    buckets = plan_for(weights, update, torch.bfloat16)
    receiver = BroadcastReceiver(
        buckets,
        strategy=update.strategy,
        inflight=update.inflight_buckets,
        flat_weights=False,
        port=1234,
        timeout_s=5,
        join_timeout_s=5,
        copy_threads=1,
    )
    return Plan.model_validate_json(Plan.of(receiver).model_dump_json()), buckets


def test_the_plan_crosses_as_json_and_comes_back_as_the_same_buckets():
    plan, buckets = plan_of(UpdateConfig(bucket_mb=0.05))
    assert len(buckets) > 1
    assert received_buckets(plan) == buckets


@pytest.mark.parametrize(
    "edit,why",
    [
        (lambda b: b[0]["slots"][1].update(offset=b[0]["slots"][1]["offset"] + 1), "not at offset"),
        (lambda b: b[0]["slots"][1].update(name=b[0]["slots"][0]["name"]), "is repeated"),
        (lambda b: b[0].update(numel=b[0]["numel"] + 7), "holds"),
        (lambda b: b[0].update(dtype="int64"), "not a floating-point dtype"),
    ],
)
def test_a_plan_that_does_not_add_up_is_refused(edit, why):
    plan, _ = plan_of(UpdateConfig(bucket_mb=1.0))
    data = plan.model_dump()
    assert len(data["buckets"][0]["slots"]) > 1
    edit(data["buckets"])
    with pytest.raises(WireError, match=why):
        received_buckets(Plan.model_validate(data))


@pytest.mark.parametrize(
    "field,value",
    [("strategy", "vllm_ipc"), ("inflight", 3), ("timeout_s", float("inf")), ("store_port", 0), ("extra", 1)],
)
def test_a_plan_with_a_value_outside_its_type_is_refused(field, value):
    plan, _ = plan_of(UpdateConfig(bucket_mb=1.0))
    with pytest.raises(ValidationError):
        Plan.model_validate({**plan.model_dump(), field: value})


def test_generate_request_and_reply_round_trip():
    from rlsync.engines.base import Generation

    state = torch.Generator().manual_seed(3).get_state()
    body = request_body("generate", ([[1, 2], [3]], 4, 0.7, state, "cpu"))
    prompts, new, temperature, back_state, device = request_args(
        "generate", GenerateRequest.model_validate_json(body.model_dump_json())
    )
    assert (prompts, new, temperature, device) == ([[1, 2], [3]], 4, 0.7, "cpu") and torch.equal(back_state, state)
    gen = Generation(
        sequences=torch.arange(6).view(2, 3),
        attention_mask=torch.ones(2, 3, dtype=torch.long),
        response_mask=torch.ones(2, 1, dtype=torch.long),
        logprobs=torch.randn(2, 1),
        prompt_len=2,
        truncated=torch.tensor([True, False]),
    )
    out, out_state = decode_result("generate", encode_result("generate", (gen, state)))
    for name, value in vars(gen).items():
        assert (
            torch.equal(getattr(out, name), value) if isinstance(value, torch.Tensor) else getattr(out, name) == value
        )
    assert torch.equal(out_state, state)
    with pytest.raises(ValidationError):
        GenerateRequest.model_validate({**body.model_dump(), "generator_device": "cuda; rm -rf /"})


def generate_body(prompts: str) -> str:
    state = TensorData.of(torch.Generator().get_state()).model_dump_json()
    return (
        f'{{"prompts": {prompts}, "max_new_tokens": 4, "temperature": 1.0, "generator_state": {state}, '
        '"generator_device": "cpu"}'
    )


BAD_IDS = [  # N02: (the prompt as sent, what the refusal says)
    pytest.param("[1, 512]", "token id 512 is outside the vocabulary: 0 to 511", id="the-vocab-size"),
    pytest.param("[1000000000]", "token id 1000000000 is outside the vocabulary: 0 to 511", id="1e9"),
    pytest.param(f"[{2**70}]", f"token id {2**70} is outside the vocabulary: 0 to 511", id="2^70"),
    pytest.param("[-5]", "token id -5 is outside the vocabulary: 0 to 511", id="negative"),
    pytest.param("[true]", "valid integer", id="true"),
    pytest.param('["4"]', "valid integer", id="a-string"),
    pytest.param("[4.0]", "valid integer", id="a-float"),
]


@pytest.mark.parametrize("prompt,why", BAD_IDS)
def test_a_token_id_outside_the_engines_vocabulary_or_not_an_integer_is_refused(prompt, why):
    """Both requests that carry token ids (a stream's prompt, a session's prompts), validated as the
    engine validates them (its vocabulary as context): refused with the field and the range."""
    context = {VOCAB_SIZE: 512}
    stream = f'{{"prompt": {prompt}, "max_new_tokens": 4}}'
    with pytest.raises(ValidationError, match=why) as caught:
        StreamRequest.model_validate_json(stream, context=context)
    assert caught.value.errors()[0]["loc"][0] == "prompt"
    with pytest.raises(ValidationError, match=why) as caught:
        GenerateRequest.model_validate_json(generate_body(f"[[3], {prompt}]"), context=context)
    assert caught.value.errors()[0]["loc"][:2] == ("prompts", 1)
    within = StreamRequest.model_validate_json('{"prompt": [0, 511], "max_new_tokens": 4}', context=context)
    assert within.prompt == [0, 511]


@pytest.mark.parametrize("field,value", [("max_new_tokens", '"4"'), ("seed", "true"), ("temperature", '"1"')])
def test_a_streams_numbers_are_not_coerced(field, value):
    with pytest.raises(ValidationError, match=field):
        StreamRequest.model_validate_json(f'{{"prompt": [1], "max_new_tokens": 4, "{field}": {value}}}')
