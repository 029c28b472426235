"""The torch_p2p wire protocol: control frames on a socket, data as tensors on a 2-rank group.

Control (one TCP connection per peer pair, optionally TLS): after the secret handshake
(p2p_channel.py), frames of a 4-byte big-endian length, a JSON object and an HMAC tag - never pickle,
so a peer can send nothing but data. Consumer -> producer:

    {"op": "hello", "device": "cpu" | "cuda"}                  first frame; both ends derive the backend
    {"op": "store_set", "key": K, "value": BASE64}             the pair group's rendezvous (both ways,
    {"op": "rendezvous_done"}                                    see p2p_group.ChannelStore), then
    {"op": "read", "spec": {ReadSpec fields}}                  serve one read (layers in spec order)
    {"op": "release", "id": HOLD_ID, "token": HOLD_TOKEN}      the reader is done with a hold
    {"op": "bye"}                                              the consumer closes the pair

Data (producer -> consumer, on the pair's process group, in request order): per requested layer, a
status tensor (uint8[STATUS_BYTES]: byte 0 = OK/ERROR, bytes 1-4 = message length, then the UTF-8
message), then K, then V ([tokens, heads, head_size] each). A read that fails on the producer (an
expired hold, a spec this rank cannot serve) still sends every layer's three messages - status
ERROR and zero-filled placeholders of the requested shape - so the stream stays aligned and the
consumer can post all of a read's receives up front. The producer checks a spec against its own layout
before it sizes anything (KVSource.check_request); a spec that fails that check drops the connection.
A read spec names the hold and its token, never block ids: the producer reads the hold's own blocks.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict
from typing import Any

import torch

from pagedserve.kv_transfer.holds import is_short_printable, shown
from pagedserve.kv_transfer.kv_source import ReadSpec

STATUS_BYTES = 256
STATUS_OK = 0
STATUS_ERROR = 1
MAX_FRAME = 1 << 20  # control frames are small; anything larger is a protocol error
MAX_SPEC_LAYERS = 4096  # more layers than any model has
_LEN = struct.Struct(">I")


class ProtocolError(ConnectionError):
    """A peer sent something that is not this protocol."""


# ---------------------------------------------------------------------- control frames


def encode_body(message: dict[str, Any]) -> bytes:
    """A control frame's JSON body (p2p_channel adds the length and the tag)."""
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise ValueError(f"control frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return body


def decode_body(body: bytes) -> dict[str, Any]:
    """A control frame's message; ProtocolError unless it is a JSON object with a string op."""
    try:
        message = json.loads(body)
    except ValueError as exc:  # also UnicodeDecodeError
        raise ProtocolError(f"control frame is not JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError("control frame nests too deeply") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ProtocolError(f"control frame without an op: {message!r:.200}")
    return message


def spec_to_json(spec: ReadSpec) -> dict[str, Any]:
    d = asdict(spec)
    d["layers"] = list(spec.layers)
    return d


def _wire_int(value: Any) -> int:
    if type(value) is not int:  # no floats, strings or booleans standing in for numbers
        raise TypeError(f"{type(value).__name__} is not an integer")
    return value


def spec_from_json(d: dict[str, Any]) -> ReadSpec:
    """Rebuild a ReadSpec from a control frame; ValueError on anything malformed. Other keys (block ids,
    an expiry) are ignored: the producer serves the hold's own blocks within its own deadline."""
    try:
        hold_id, token, layers = d["remote_request_id"], d["hold_token"], d["layers"]
        if not is_short_printable(hold_id) or not is_short_printable(token):
            raise ValueError("the hold id and token must be 1-128 printable ASCII characters")
        if not isinstance(layers, list) or len(layers) > MAX_SPEC_LAYERS:
            raise ValueError(f"layers must be a list of at most {MAX_SPEC_LAYERS}")
        spec = ReadSpec(
            remote_request_id=hold_id,
            hold_token=token,
            token_start=_wire_int(d["token_start"]),
            token_end=_wire_int(d["token_end"]),
            layers=tuple(_wire_int(layer) for layer in layers),
            head_start=_wire_int(d["head_start"]),
            head_end=_wire_int(d["head_end"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed read spec: {str(exc)[:200]}") from None
    check_spec_shape(spec)
    return spec


def check_spec_shape(spec: ReadSpec) -> None:
    """The sizes both sides derive from a spec must be sane before anything is allocated (the producer
    also bounds them by its own layout: KVSource.check_request)."""
    if spec.num_tokens <= 0 or spec.head_end <= spec.head_start or not spec.layers:
        raise ValueError(f"read of hold {shown(spec.remote_request_id)}: empty or negative range "
                         f"(tokens [{spec.token_start}, {spec.token_end}), heads [{spec.head_start}, "
                         f"{spec.head_end}), layers {str(spec.layers)[:100]})")
    if list(spec.layers) != sorted(set(spec.layers)):
        raise ValueError(f"read of hold {shown(spec.remote_request_id)}: layers {str(spec.layers)[:100]} are not ascending")


# ---------------------------------------------------------------------- data messages


def layer_shape(spec: ReadSpec, head_size: int) -> tuple[int, int, int]:
    """The shape of one layer's K (and V) in a read: [tokens, heads, head_size]."""
    return spec.num_tokens, spec.head_end - spec.head_start, head_size


def encode_status(error: str | None, device: torch.device | str = "cpu") -> torch.Tensor:
    out = torch.zeros(STATUS_BYTES, dtype=torch.uint8)
    if error is not None:
        msg = error.encode("utf-8", "replace")[: STATUS_BYTES - 5]
        out[0] = STATUS_ERROR
        out[1:5] = torch.tensor(list(_LEN.pack(len(msg))), dtype=torch.uint8)
        if msg:
            out[5 : 5 + len(msg)] = torch.frombuffer(bytearray(msg), dtype=torch.uint8)
    return out.to(device)


def decode_status(status: torch.Tensor) -> str | None:
    """None for OK, else the producer's error message."""
    raw = bytes(status.cpu().tolist())
    if len(raw) != STATUS_BYTES:
        raise ProtocolError(f"status message of {len(raw)} bytes, expected {STATUS_BYTES}")
    if raw[0] == STATUS_OK:
        return None
    if raw[0] != STATUS_ERROR:
        raise ProtocolError(f"unknown status {raw[0]}")
    (length,) = _LEN.unpack(raw[1:5])
    return raw[5 : 5 + min(length, STATUS_BYTES - 5)].decode("utf-8", "replace") or "unknown producer error"


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown KV dtype {name!r}")
    return dtype
