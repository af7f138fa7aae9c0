"""The one loop that halves a call's items when it runs out of memory: ``encode_images``' padded and packed
paths and vLLM's out-of-memory guard all run their calls through ``HalvingChunks``."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["HalvingChunks", "empty_cache"]

Result = TypeVar("Result")


class HalvingChunks:
    """The most items a call may take (None: no cap), halved each time a call of more than one item runs out
    of memory (``torch.OutOfMemoryError``); one item's error reaches the caller. The sizes that failed are
    kept for one warning at the end."""

    def __init__(self, size: int | None, device: torch.device):
        self.size = size
        self.device = device
        self.failed: list[int] = []

    def run(self, call: Callable[[int | None], Result], items_of: Callable[[int | None], int] | None = None) -> Result:
        """``call(size)`` until it fits; ``items_of(size)``: the items a call at that cap took (default: the cap)."""
        while True:
            try:
                return call(self.size)
            except torch.OutOfMemoryError:
                self.failed.append(self.size if items_of is None else items_of(self.size))
                if self.failed[-1] <= 1:
                    raise
            # Out of the handler: the error's frames, and the chunk's tensors they hold, are gone.
            self.size = self.failed[-1] // 2
            empty_cache(self.device)

    def run_consecutive(
        self, count: int, take: Callable[[int, int | None], int], encode: Callable[[int, int], list]
    ) -> list:
        """Items ``[0, count)`` through consecutive calls ``encode(start, end)``, each returning its items'
        results; ``end = take(start, size)``, at most ``size`` items from ``start`` and at least one."""
        outputs: list = []
        while len(outputs) < count:
            start = len(outputs)
            outputs += self.run(lambda size: encode(start, take(start, size)), lambda size: take(start, size) - start)
        return outputs

    def warn(self, who: str, per: str, stacklevel: int) -> None:
        """One RuntimeWarning naming the sizes that ran out of memory and what followed, if any did;
        ``stacklevel`` counts from the caller of ``warn``."""
        if all(items <= 1 for items in self.failed):  # nothing was halved: the caller meets the error alone
            return
        sizes = " -> ".join(map(str, self.failed))
        outcome = "re-raised the last error" if self.failed[-1] <= 1 else f"went on with at most {self.size}"
        message = f"{who} ran out of memory at {sizes} items per {per}; {outcome}"
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


def empty_cache(device: torch.device) -> None:
    """Hand the caching allocator's free blocks back, so the smaller chunk does not meet the same fragments."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type != "cpu" and hasattr(torch, device.type):
        getattr(torch, device.type).empty_cache()
