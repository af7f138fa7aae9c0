"""What an engine plugin tells its operator, once per process, through the engine's own logger at INFO: the
classes it patched, the backend each op resolves to on the engine's device, and every fallback so far with
its reason. ``fused_vision.integrations.vllm`` and ``.sglang`` compose their lines from these pieces.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from .. import _dispatch, patching

__all__ = ["backend_on", "fallbacks", "log_once", "patched_classes", "pending"]

_LOGGED: set[str] = set()


def pending(key: str) -> bool:
    """Whether this process has yet to log under ``key``: what to compose a line for."""
    return key not in _LOGGED


def log_once(logger: logging.Logger, key: str, message: str, *args) -> bool:
    """``logger.info(message, *args)`` the first time this process asks under ``key``; whether it logged."""
    if key in _LOGGED:
        return False
    _LOGGED.add(key)
    logger.info(message, *args, stacklevel=2)  # the line of the integration that reports
    return True


def backend_on(state, device: torch.device, op: str | None = None) -> str:
    """What a module patched with ``state`` (a ``stem.FusedOp``; None: stock code) runs on ``device``:
    "triton", "triton (interpreted)" on a CPU, "reference", or "stock"; ``op``: the op whose Triton failure
    would send it to the reference."""
    if state is None:
        return "stock"
    try:
        chosen = _dispatch.resolve_backend(state.backend, device)
    except (RuntimeError, ValueError) as exc:  # backend="triton" where Triton cannot run, a bad override
        return f"none ({exc})"
    if chosen == "reference" or (chosen == "auto" and (op or state.op, device.type) in _dispatch._failed):
        return "reference"
    return "triton (interpreted)" if device.type == "cpu" else "triton"


def patched_classes(classes: Iterable[type]) -> list[str]:
    """``Class -> state`` for each of ``classes`` that is patched."""
    return [f"{cls.__name__} -> {patching.fused_state(cls)}" for cls in classes if patching.fused_state(cls)]


def fallbacks() -> str:
    """Every fallback this process took so far, with its reason; "none" where it took none."""
    return "; ".join(_dispatch.fallbacks()) or "none"
