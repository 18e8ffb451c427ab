"""Pipeline parallelism in the model runner: the last stage samples, and every stage learns the tokens.

Each stage keeps the same request states (the scheduler output reaches every rank), and the next step's
inputs are built from them: the first stage embeds the sampled tokens, the others need their count for
positions and KV slots. So after the last stage samples, its first rank broadcasts the step's token ids
to every rank (one small int64 tensor per step that samples), and a stage that did not sample appends
them as if it had. The activations themselves travel inside the model's forward (models/llama.py).

With micro-batches in flight (async scheduling, engine_core/micro_batches.py) there is no broadcast: the
engine core sends each cached request's tokens with the step that schedules it again, and a stage that
did not sample takes them from there (`take_token_ids`), so no stage waits on the last one's sampling.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncengine import parallel_state as parallel


def share_sampled_tokens(token_ids: list[int], device: torch.device) -> None:
    """On the last stage: the tokens it sampled this step, to every other stage."""
    if parallel.pipeline_size() > 1 and token_ids:
        parallel.broadcast_from_last_stage(torch.tensor(token_ids, dtype=torch.int64, device=device))


def receive_sampled_tokens(count: int, device: torch.device) -> list[int]:
    """On any stage but the last: the `count` tokens the last stage sampled this step."""
    if count == 0:
        return []
    tokens = torch.empty(count, dtype=torch.int64, device=device)
    parallel.broadcast_from_last_stage(tokens)
    return tokens.tolist()


def take_token_ids(requests: dict[str, Any], token_ids: dict[str, list[int]]) -> None:
    """On any stage but the last, with micro-batches: each request's tokens from max(num_computed_tokens,
    prompt length) on, as the engine core holds them (its state's num_computed_tokens is this step's)."""
    for request_id, tokens in token_ids.items():
        state = requests.get(request_id)
        if state is None:
            continue  # this worker refused it (failed_request_ids): the scheduler has not learnt it yet
        num_prompt = len(state.prompt_token_ids)
        start = max(state.num_computed_tokens, num_prompt)
        del state.token_ids[start:]
        state.token_ids.extend(tokens)
        del state.output_token_ids[start - num_prompt:]  # in place: logits processors hold this list
        state.output_token_ids.extend(tokens)
