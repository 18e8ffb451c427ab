"""TokenizerPool: the worker threads where the frontend tokenizes prompts, decodes whole token lists
and renders chat templates.

These are CPU-bound calls into the tokenizer (a 2 MB prompt takes about a second); on the event
loop they would stall every stream and every other request for that long. They run in threads
instead, at most `size` at a time (an anyio CapacityLimiter, first come first served): a flood of
long prompts queues for the pool while the event loop goes on serving. One pool per AsyncEngine,
shared by the server's routes and the Python API (`AsyncEngine.generate`, `LLM.generate` / `chat`),
so that together they never take more than `size` threads' worth of CPU for tokenizing. Images are
decoded and processed in a second pool of the same size (`AsyncEngine.media_pool`): a burst of large
images (a 49 KB PNG may hold 16 megapixels, about a second of work) queues there, not ahead of text.

Per-token detokenization of outputs stays on the event loop: it is incremental, a few
microseconds per token, and a thread hop would cost more than it saves.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")

# Half the CPUs, 1 to 4: several long prompts at once on a larger machine, and the other half for the
# event loop and the engine core. Measured on 2 cores, a 16-token request while four clients loop
# 1 MB /tokenize calls: 2.1 s with one thread, 4.2 s with two, 10.6 s tokenizing on the loop.
DEFAULT_SIZE = max(1, min(4, (os.cpu_count() or 1) // 2))


class TokenizerPool:
    def __init__(self, size: int | None = None) -> None:
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"a tokenizer pool needs at least one thread, got size={size!r}")
        self.limiter = anyio.CapacityLimiter(size or DEFAULT_SIZE)

    @property
    def size(self) -> int:
        return int(self.limiter.total_tokens)

    async def run(self, function: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`function(*args, **kwargs)` in one of the pool's threads. Cancelling the caller waits for the
        call to end (a tokenizer call cannot be interrupted), so the pool never runs more than `size`."""
        return await anyio.to_thread.run_sync(functools.partial(function, *args, **kwargs), limiter=self.limiter)
