"""The typed messages between a trainer and a standalone engine (`python -m rlsync.serve`), as JSON.

Every request body and reply on the control plane is one of these pydantic models, validated on
arrival: a field of the wrong type, a dtype outside `WIRE_DTYPES`, a plan whose layout does not add
up is rejected before anything acts on it. Nothing here is ever unpickled. Tensors that must cross
(the sampler's state, the generated batch, the weights a test reads back) travel by value as
`TensorData`: dtype name, shape and the raw bytes in base64. The weights of an update do not travel
here: they go over the torch.distributed group (rlsync/update/broadcast.py).

    GET  /health                      -> Health (no token needed; says whether a session is on)
    POST /v1/session   Plan           -> 200 + a stream of SessionEvent lines while the session lasts
                                         | 409 Failure (EngineBusy) | 422 Failure (PlanMismatch, bad plan)
    POST /v1/{op}      (op's request) -> 200 Reply | 500 Failure (the engine raised) | 409 (no such session)
         op: open (join the group), update, generate, release, resume, checksums, weights, close
"""

from __future__ import annotations

import base64
import math
from typing import Annotated, Literal, Optional

import torch
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from rlsync.config.schema import COPY_THREADS_MAX
from rlsync.engines.base import Generation

# Every dtype that may cross the wire, by name (never looked up on torch by a name we were sent).
WIRE_DTYPES = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
DtypeName = Literal["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
OPS = ("open", "update", "generate", "release", "resume", "checksums", "weights", "close")
SESSION_HEADER = "X-Rlsync-Session"  # names the session a request belongs to (from the "accepted" event)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


VOCAB_SIZE = "vocab_size"  # the validation context's key: the engine's vocabulary, which token ids must fall in


def in_vocabulary(token: int, info: ValidationInfo) -> int:
    """A token id is 0 or more, and below the engine's vocabulary size where the engine validates it
    (`model_validate_json(body, context={VOCAB_SIZE: n})`): refused up front, not at the embedding."""
    vocab = (info.context or {}).get(VOCAB_SIZE)
    if token < 0 or (vocab is not None and token >= vocab):
        allowed = f"0 to {vocab - 1} (this engine's model.vocab_size={vocab})" if vocab is not None else "0 or more"
        raise PydanticCustomError(
            "token_id", "token id {token} is outside the vocabulary: {allowed}", {"token": token, "allowed": allowed}
        )
    return token


# A token id: a JSON integer (never true, "4" or 4.0, which a lax int would take), in the vocabulary
TokenId = Annotated[StrictInt, AfterValidator(in_vocabulary)]


class WireError(ValueError):
    """A message that is well-formed JSON but cannot mean what it says (a layout that does not add up)."""


# ----------------------------------------------------------------------------------------------
# Tensors by value
# ----------------------------------------------------------------------------------------------


class TensorData(Message):
    dtype: DtypeName
    shape: list[int] = Field(max_length=8)
    data: str  # base64 of the tensor's bytes, C order, this machine's byte order

    @field_validator("shape")
    @classmethod
    def _sizes(cls, shape: list[int]) -> list[int]:
        if any(d < 0 for d in shape):
            raise ValueError("negative size")
        return shape

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorData:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return cls(dtype=DTYPE_NAMES[tensor.dtype], shape=list(tensor.shape), data=base64.b64encode(raw).decode())

    def tensor(self) -> torch.Tensor:
        dtype = WIRE_DTYPES[self.dtype]
        raw = base64.b64decode(self.data, validate=True)
        numel = math.prod(self.shape)
        if len(raw) != numel * dtype.itemsize:
            raise WireError(
                f"a {self.dtype} tensor of shape {self.shape} needs {numel * dtype.itemsize} bytes, got {len(raw)}"
            )
        if not raw:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(self.shape)


# ----------------------------------------------------------------------------------------------
# The session: the trainer's plan, and the engine's events while the session lasts
# ----------------------------------------------------------------------------------------------


class PlanSlot(Message):
    name: str = Field(min_length=1, max_length=1024)
    shape: list[int] = Field(max_length=8)
    offset: int = Field(ge=0)


class PlanBucket(Message):
    dtype: DtypeName
    numel: int = Field(ge=1)
    slots: list[PlanSlot] = Field(min_length=1)


class Plan(Message):
    """The trainer's half of the broadcast transport (rlsync/update/broadcast.py's BroadcastReceiver, less
    what the engine decides itself: which addresses to use); the engine reads its buckets back
    with rlsync/serve/app.py's `received_buckets`, which checks that their layout adds up."""

    buckets: list[PlanBucket] = Field(min_length=1)
    strategy: Literal["bucketed", "per_tensor"]
    inflight: int = Field(ge=1, le=2)
    flat_weights: bool
    copy_threads: int = Field(ge=0, le=COPY_THREADS_MAX)
    store_port: int = Field(ge=1, le=65535)  # the trainer's TCP store, at the address it connected from
    timeout_s: float = Field(gt=0, allow_inf_nan=False)  # one broadcast's longest wait (the engine caps it)
    join_timeout_s: float = Field(gt=0, allow_inf_nan=False)  # the store and the rendezvous (capped too)

    @classmethod
    def of(cls, receiver) -> Plan:
        buckets = [
            PlanBucket(
                dtype=DTYPE_NAMES[b.dtype],
                numel=b.numel,
                slots=[PlanSlot(name=s.meta.name, shape=list(s.meta.shape), offset=s.offset) for s in b.slots],
            )
            for b in receiver.buckets
        ]
        return cls(
            buckets=buckets,
            strategy=receiver.strategy,
            inflight=receiver.inflight,
            flat_weights=receiver.flat_weights,
            copy_threads=receiver.copy_threads,
            store_port=receiver.port,
            timeout_s=receiver.timeout_s,
            join_timeout_s=receiver.join_timeout_s,
        )


class SessionEvent(Message):
    """One line of the session stream: accepted (first), then a heartbeat every second, then ended."""

    event: Literal["accepted", "heartbeat", "ended"]
    session: Optional[str] = None  # with "accepted": what each request of the session names (SESSION_HEADER)
    detail: Optional[str] = None  # with "ended": how


class Health(Message):
    status: Literal["ok"]
    model: str
    busy: bool  # a trainer's session is on
    op: Optional[str] = None  # the request the engine is working on, if any


# ----------------------------------------------------------------------------------------------
# Requests and replies of a session
# ----------------------------------------------------------------------------------------------


class Empty(Message):
    """The body of a request with no arguments (open, update, release, resume, checksums, weights, close)."""


class GenerateRequest(Message):
    prompts: list[list[TokenId]] = Field(min_length=1)
    max_new_tokens: StrictInt = Field(ge=1)
    temperature: StrictFloat = Field(ge=0, allow_inf_nan=False)
    generator_state: TensorData
    generator_device: str = Field(pattern=r"^(cpu|cuda(:[0-9]{1,3})?)$")


class OpenResult(Message):
    staging_bytes: int


class LoadResult(Message):
    load_times: list[float]
    peak_extra: int


class GenerationData(Message):
    sequences: TensorData
    attention_mask: TensorData
    response_mask: TensorData
    logprobs: TensorData
    prompt_len: int
    truncated: TensorData


class GenerateResult(Message):
    generation: GenerationData
    generator_state: TensorData


class ChecksumsResult(Message):
    checksums: dict[str, int]


class WeightsResult(Message):
    weights: dict[str, TensorData]


class Reply(Message):
    """A request answered: its result (the op's result model, or None) and the engine's clock stamps
    around the work (time.monotonic; comparable with the trainer's on one machine only)."""

    op: str
    result: Optional[dict] = None
    t_recv: float
    t_send: float
    t_prev_send: float


class Failure(Message):
    """A request refused or failed: `error` starts with the reason's name (EngineBusy, PlanMismatch,
    NoSession, BadRequest, Unauthorized) or is the engine's traceback (ending in its last line)."""

    op: str
    error: str


REQUESTS: dict[str, type[Message]] = dict.fromkeys(OPS, Empty) | {"generate": GenerateRequest}
RESULTS: dict[str, Optional[type[Message]]] = {
    "open": OpenResult,
    "update": LoadResult,
    "generate": GenerateResult,
    "checksums": ChecksumsResult,
    "weights": WeightsResult,
    "release": None,
    "resume": None,
    "close": None,
}


def encode_result(op: str, result) -> Optional[dict]:
    """What EngineServer's `op` returned, as its result model (a plain dict for the Reply)."""
    if op == "open":
        return OpenResult(**result).model_dump()
    if op == "update":
        return LoadResult(**result).model_dump()
    if op == "generate":
        gen, state = result
        data = {k: (TensorData.of(v) if isinstance(v, torch.Tensor) else v) for k, v in vars(gen).items()}
        return GenerateResult(generation=GenerationData(**data), generator_state=TensorData.of(state)).model_dump()
    if op == "checksums":
        return ChecksumsResult(checksums=result).model_dump()
    if op == "weights":
        return WeightsResult(weights={k: TensorData.of(v) for k, v in result.items()}).model_dump()
    return None


def decode_result(op: str, result: Optional[dict]):
    """A Reply's result back into what EngineServer's `op` returned (what the trainer's code expects)."""
    model = RESULTS[op]
    if model is None:
        return None
    typed = model.model_validate(result)
    if isinstance(typed, (OpenResult, LoadResult)):
        return typed.model_dump()
    if isinstance(typed, GenerateResult):
        fields = {k: (v.tensor() if isinstance(v, TensorData) else v) for k, v in vars(typed.generation).items()}
        return Generation(**fields), typed.generator_state.tensor()
    if isinstance(typed, ChecksumsResult):
        return dict(typed.checksums)
    return {k: v.tensor() for k, v in typed.weights.items()}


def request_body(op: str, args: tuple) -> Message:
    """The request model for EngineServer's `op` called with `args`."""
    if op == "generate":
        prompts, max_new_tokens, temperature, state, device = args
        return GenerateRequest(
            prompts=[list(map(int, p)) for p in prompts],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            generator_state=TensorData.of(state),
            generator_device=device,
        )
    return Empty()


def request_args(op: str, body: Message) -> tuple:
    """EngineServer's `op` arguments from its request model (the inverse of `request_body`)."""
    if isinstance(body, GenerateRequest):
        return (
            body.prompts,
            body.max_new_tokens,
            body.temperature,
            body.generator_state.tensor(),
            body.generator_device,
        )
    return ("update",) if op == "update" else ()
