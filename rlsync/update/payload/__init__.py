"""Update payloads: what one bucket carries between the trainer's weights and the transport.

A payload encodes a bucket on the trainer's side, into the staging buffer the transport moves, and
decodes it into the engine's weights on the other side. Transports move the bytes and never look
inside them. `full` (every element, in the engine's dtype) is the default; `delta`
(`update.delta=true`) sends only the elements whose engine-dtype value changed since the last update
(rlsync/update/payload/delta.py). Adding one is a module holding a `Payload` subclass and one line in
`PAYLOADS` (rlsync/update/payload/base.py).
"""

from rlsync.update.payload.base import (
    Encoded,
    Encoder,
    Floor,
    Payload,
    payload_bandwidth,
    payload_class,
    payload_floor_line,
    payload_floor_metrics,
    payload_name,
    payload_of,
)

__all__ = [
    "Encoded",
    "Encoder",
    "Floor",
    "Payload",
    "payload_bandwidth",
    "payload_class",
    "payload_floor_line",
    "payload_floor_metrics",
    "payload_name",
    "payload_of",
]
