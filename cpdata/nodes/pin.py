"""Pin batches in page-locked host memory when a CUDA device can use them (asynchronous host-to-device
copies). torchdata's ``PinMemory`` raises on CPU-only builds, so the decision is made once, here.
"""

from __future__ import annotations

import functools
import logging
from typing import TypeVar

import torch
from torchdata.nodes import BaseNode, PinMemory

__all__ = ["maybe_pin", "resolve_pin_memory"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)


def resolve_pin_memory(pin_memory: bool | None) -> bool:
    """``None`` means "pin when CUDA is available"; ``True`` without CUDA falls back to no pinning."""
    cuda = torch.cuda.is_available()
    if pin_memory is None:
        return cuda
    if pin_memory and not cuda:
        _log_once("pin_memory=True but CUDA is not available; batches stay in pageable memory")
        return False
    return bool(pin_memory)


def maybe_pin(node: BaseNode[T], *, pin_memory: bool | None) -> BaseNode[T]:
    """``PinMemory(node)`` (one thread calling each item's ``pin_memory()``; resume stays exact) when
    pinning applies (:func:`resolve_pin_memory`), else ``node``."""
    if not resolve_pin_memory(pin_memory):
        if pin_memory is None:
            _log_once("CUDA is not available; not pinning batches")
        return node
    return PinMemory(node)
