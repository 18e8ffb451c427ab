"""CUDA graphs for decode steps: the whole forward pass of a decode batch replayed as one launch.

Why: a decode step of a small model on a large GPU is bound by kernel launches, not by the GPU (a 28-layer
model launches several hundred kernels per step, each with Python dispatch before it). A graph
captured once per batch size replays all of them at the cost of one launch.

How: the graph reads its inputs from static device buffers sized for the largest captured batch.
A step of `n` decoding sequences runs in the graph of the smallest captured size `>= n`; its inputs are
copied into the front of the buffers and the rows past `n` are padding, made harmless: their slot is -1
(the KV store skips it) and their context length 0 (attention reads no cache for them and writes zeros).
Each row of a decode batch is computed independently of the others, so padding never changes a real
row. Only the hidden states of the first `n` rows are used.

What may be captured: the attention backends of every layer must say `cuda_graph_safe = True`: in a
decode step they read only device tensors of the metadata (`seq_lens_tensor`, `block_tables`,
`slot_mapping`) and take their launch grid from shapes, never from values on the host. TRITON_PAGED
does; TORCH_PAGED does not (it plans each step from Python lists), so a run on it stays eager.

`capture=False` runs the same padded, static-buffer path eagerly: how the padding is checked on CPU,
where there are no graphs.
"""

from __future__ import annotations

import torch

from asyncengine.models.layers.attention import AttentionMetadata


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to the largest batch (which is always included)."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    sizes.append(max_batch_size)
    return sizes


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, device: torch.device, *, max_batch_size: int,
                 max_blocks_per_seq: int, block_size: int, capture: bool) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.sizes = capture_sizes(max_batch_size)
        self.capture_enabled = capture
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(largest, max_blocks_per_seq, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # Decode steps run since enabled, by (sequences, the padded size they ran at): for benchmarks and tests.
        self.runs: dict[tuple[int, int], int] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, num_seqs: int) -> int | None:
        """The smallest captured batch size that holds `num_seqs` sequences (None: too many)."""
        for size in self.sizes:
            if size >= num_seqs:
                return size
        return None

    def _metadata(self, size: int) -> AttentionMetadata:
        ones = [1] * size
        metadata = AttentionMetadata(
            self.slot_mapping[:size], None, ones, ones, self.block_tables[:size], block_size=self.block_size,
            query_start_loc=self.query_start_loc[: size + 1], seq_lens_tensor=self.seq_lens[:size],
            max_query_len=1, decode_only=True,
        )
        # The context lengths live on the device only (the host lists above are placeholders a
        # graph-safe backend does not read); None tells a kernel to size its grid from block_tables.
        metadata.max_seq_len = None
        return metadata

    def capture(self) -> None:
        """Capture one graph per size, largest first, all sharing one memory pool."""
        pool = None
        for size in reversed(self.sizes):
            metadata = self._metadata(size)
            # Warm-up outside the graph: compiles the Triton kernels for this shape and settles the
            # allocator, neither of which may happen during capture.
            self.model(self.input_ids[:size], self.positions[:size], metadata)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(self.input_ids[:size], self.positions[:size], metadata)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """The hidden states `[n, hidden]` of a decode step of `n <= max_batch_size` sequences."""
        num_seqs = input_ids.shape[0]
        size = self.size_for(num_seqs)
        if size is None or not metadata.decode_only:
            raise ValueError(f"DecodeGraphs.run takes decode steps of at most {self.max_batch_size} sequences; "
                             f"got {num_seqs} tokens (decode only: {metadata.decode_only}); run it eagerly")
        width = metadata.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"a decode step needs {width} blocks per sequence, more than the "
                             f"{self.block_tables.shape[1]} the graphs were captured with (max_model_len)")
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(metadata.slot_mapping)
        self.slot_mapping[num_seqs:size].fill_(-1)
        self.seq_lens[:num_seqs].copy_(metadata.seq_lens_tensor)
        self.seq_lens[num_seqs:size].zero_()
        self.block_tables[:num_seqs, :width].copy_(metadata.block_tables)
        self.runs[num_seqs, size] = self.runs.get((num_seqs, size), 0) + 1
        if self.capture_enabled:
            self.graphs[size].replay()
            return self.outputs[size][:num_seqs]
        return self.model(self.input_ids[:size], self.positions[:size], self._metadata(size))[:num_seqs]
