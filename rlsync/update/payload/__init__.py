"""Update payloads: what one bucket carries between the trainer's weights and the transport.

A payload encodes a bucket on the trainer's side, into the staging buffer the transport moves, and
decodes it into the engine's weights on the other side. Transports move the bytes and never look
inside them. `update.payload` chooses one by its name in the registry (`PAYLOADS`,
rlsync/update/payload/base.py); `full` (every element, in the engine's dtype) is the default. Each payload
class describes itself (its title, rules, bytes, floors, metrics, what a verified run says), so nothing
outside this package names a payload. Adding one is a module holding a `Payload` subclass and one line in
`PAYLOADS` (docs/payloads.md).
"""

from rlsync.update.payload.base import (
    KEY,
    Encoded,
    Encoder,
    Floor,
    Payload,
    PlanContext,
    payload_bandwidth,
    payload_class,
    payload_floor_line,
    payload_floor_metrics,
    payload_name,
    payload_names,
    payload_of,
    recorded_class,
    recorded_payload,
    register_payload,
    replaced_key,
)

__all__ = [
    "KEY",
    "Encoded",
    "Encoder",
    "Floor",
    "Payload",
    "PlanContext",
    "payload_bandwidth",
    "payload_class",
    "payload_floor_line",
    "payload_floor_metrics",
    "payload_name",
    "payload_names",
    "payload_of",
    "recorded_class",
    "recorded_payload",
    "register_payload",
    "replaced_key",
]
