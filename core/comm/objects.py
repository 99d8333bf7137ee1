"""Picklable objects as uint8 tensors, for control-plane messages.

Every message is signed: an HMAC-SHA256 of the pickle under the job's secret comes first,
and a receiver checks it before unpickling, so bytes from anyone without the secret (or
garbled on the way) are refused with :class:`~shardline.errors.ProtocolError` and never
reach ``pickle.loads``.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
from typing import Any

import numpy as np
import torch

from shardline.errors import ProtocolError

TAG_BYTES = hashlib.sha256().digest_size


def seal(obj: Any, secret: bytes) -> bytes:
    """``obj`` pickled, preceded by its HMAC-SHA256 under ``secret``."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return hmac.new(_checked(secret, "send"), data, hashlib.sha256).digest() + data


def unseal(raw: bytes, secret: bytes, sender: str = "a peer") -> Any:
    """The object :func:`seal` made with the same ``secret``.

    Raises :class:`ProtocolError` naming ``sender`` when the signature does not match or
    the signed bytes do not unpickle; nothing unsigned is unpickled.
    """
    data = verified_pickle(raw, secret, sender)
    try:
        return pickle.loads(data)
    except Exception as error:
        raise ProtocolError(
            f"control-plane object from {sender} is signed but does not unpickle: "
            f"{type(error).__name__}: {error}"
        ) from error


def verified_pickle(raw: bytes, secret: bytes, sender: str = "a peer") -> bytes:
    """The pickle inside ``raw``, a message :func:`seal` made with the same ``secret``, not
    yet loaded (for a receiver that handles a pickle that does not load itself). Raises
    :class:`ProtocolError` naming ``sender`` when the signature does not match."""
    tag, data = raw[:TAG_BYTES], raw[TAG_BYTES:]
    expected = hmac.new(_checked(secret, "receive"), data, hashlib.sha256).digest()
    if len(raw) < TAG_BYTES or not hmac.compare_digest(tag, expected):
        raise ProtocolError(
            f"control-plane object from {sender} ({len(raw)} bytes) fails the job-secret "
            "check: refused unread (a process outside this job, a garbled message, or ranks "
            "started with different secrets)"
        )
    return data


def to_tensor(obj: Any, secret: bytes, device: str = "cpu") -> torch.Tensor:
    """``obj`` sealed with ``secret`` (:func:`seal`) as a 1-D uint8 tensor on ``device``."""
    return torch.frombuffer(bytearray(seal(obj, secret)), dtype=torch.uint8).to(device)


def from_tensor(tensor: torch.Tensor, secret: bytes, sender: str = "a peer") -> Any:
    """The object in a tensor made by :func:`to_tensor` with the same ``secret``
    (:func:`unseal`)."""
    return unseal(np.asarray(tensor.cpu()).tobytes(), secret, sender)


def _checked(secret: bytes, direction: str) -> bytes:
    if not secret:
        raise ProtocolError(
            f"cannot {direction} a control-plane object: no job secret (a control plane is "
            "made with the rendezvous's secret)"
        )
    return secret
