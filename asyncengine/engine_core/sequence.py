"""Sequence: the engine core's view of one request while it is waiting, running or preempted."""

from __future__ import annotations

import enum
import hashlib
import struct

from asyncengine.wire.engine_core import EngineCoreRequest, SamplingOptions


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


def hash_block(parent: bytes | None, token_ids: list[int], extra_keys: tuple[str, ...] = ()) -> bytes:
    """Content hash of one full block, chained to its parent so equal hashes mean equal prefixes.

    `extra_keys`: what the tokens alone do not say about the block's keys and values, the identifiers (content
    hashes) of the images whose placeholder tokens sit in it: the same placeholder tokens for another image
    are another block (vLLM's extra keys)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent or b"root")
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    for key in extra_keys:
        digest.update(b"\x00mm:" + key.encode("utf-8", "surrogatepass"))
    return digest.digest()


class Sequence:
    """Token ids (prompt then output), progress, and the KV blocks that hold them."""

    def __init__(self, request: EngineCoreRequest, block_size: int, arrival_index: int, num_kv_groups: int = 1) -> None:
        self.request_id = request.request_id
        self.sampling: SamplingOptions = request.sampling
        self.arrival_index = arrival_index
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens scheduled to be sampled whose result has not come back yet (async scheduling runs
        # the next step's schedule before the previous step's tokens are known).
        self.num_pending_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first scheduling
        self.num_external_tokens = 0  # prompt tokens a KV connector supplied at the latest admission
        # Per KV cache group (wire/kv_cache.py; one unless the model has sliding-window layers), its block ids.
        self.block_tables: list[list[int]] = [[] for _ in range(num_kv_groups)]
        self.num_registered_blocks = 0  # leading blocks already named in the prefix cache
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        self.num_preemptions = 0
        self._block_size = block_size
        self._block_hashes: list[bytes] = []
        # A pooling request (PoolingOptions): scheduled whole, finished by its pooled output after its prefill.
        self.pooling = request.pooling
        # The LoRA adapter (None: the base model). The same tokens under another adapter have other keys
        # and values, so the adapter's id roots the chain of block hashes: prefix hits stay per adapter.
        self.lora_request = request.lora_request
        self.lora_int_id = request.lora_request.lora_int_id if request.lora_request is not None else 0
        # A cache salt roots it too (and the adapter's id with it): blocks are shared only within one salt.
        self.priority = request.priority
        root = b"" if self.lora_int_id == 0 else b"lora:%d" % self.lora_int_id
        if request.cache_salt is not None:
            root += b"salt:" + request.cache_salt.encode("utf-8", "surrogatepass")
        self._root_hash = root or None
        # Its images (wire/multimodal.py), in prompt order: their identifiers join the hashes of the blocks their
        # placeholder tokens sit in, and the scheduler budgets and caches their encoder outputs.
        self.mm_features = list(request.mm_features or ())
        self.encoder_refs: set[int] = set()  # indices of the items whose encoder-cache entry it references

    @property
    def block_ids(self) -> list[int]:
        """The first KV cache group's blocks (the only group of a model without sliding windows)."""
        return self.block_tables[0]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def block_hashes(self) -> list[bytes]:
        """Hashes of every full block of tokens, extended lazily as tokens arrive."""
        size = self._block_size
        num_full = len(self.token_ids) // size
        while len(self._block_hashes) < num_full:
            index = len(self._block_hashes)
            parent = self._block_hashes[-1] if self._block_hashes else self._root_hash
            start, end = index * size, (index + 1) * size
            self._block_hashes.append(hash_block(parent, self.token_ids[start:end], self._extra_keys(start, end)))
        return self._block_hashes

    def _extra_keys(self, start: int, end: int) -> tuple[str, ...]:
        """The identifiers of the items whose placeholder span overlaps tokens [start, end)."""
        if not self.mm_features:
            return ()
        return tuple(feature.identifier for feature in self.mm_features
                     if feature.position.offset < end and start < feature.position.offset + feature.position.length)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
