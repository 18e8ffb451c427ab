"""The scheduler with multimodal items: images' identifiers in the prefix-cache keys, the encoder budget and
cache (engine_core/encoder_cache.py), chunks that split an image, and no encoder-cache leak on abort/preemption.

`EncoderWorker` plays the worker's part for the encoder cache: it drops what `free_encoder_mm_hashes` names,
computes what `scheduled_encoder_inputs` names (an error if it holds it already), and checks that every
scheduled token inside an image's span finds the image's embeddings in its cache.
"""

from __future__ import annotations

import pytest

from asyncengine.engine_core.block_manager import BlockManager
from asyncengine.engine_core.scheduler import Scheduler
from asyncengine.engine_core.sequence import Sequence
from asyncengine.wire.engine_core import EngineCoreRequest, SamplingOptions
from asyncengine.wire.multimodal import MultiModalFeature, PlaceholderRange
from asyncengine.wire.worker import ModelRunnerOutput, SchedulerOutput

BLOCK = 4
IMAGE_TOKEN = 9


def image(identifier: str, offset: int, length: int, is_embed: list[bool] | None = None) -> MultiModalFeature:
    return MultiModalFeature(modality="image", identifier=identifier,
                             position=PlaceholderRange(offset=offset, length=length, is_embed=is_embed), data={})


def prompt_with(images: list[tuple[str, int]], *, text_before: int = 5, text_between: int = 3,
                text_after: int = 2) -> tuple[list[int], list[MultiModalFeature]]:
    """Tokens: text, then per image `length` image tokens and some text; and the features."""
    tokens = list(range(100, 100 + text_before))
    features = []
    for identifier, length in images:
        features.append(image(identifier, len(tokens), length))
        tokens += [IMAGE_TOKEN] * length + list(range(200, 200 + text_between))
    tokens += list(range(300, 300 + text_after))
    return tokens, features


def request(request_id: str, tokens: list[int], features: list[MultiModalFeature], max_tokens: int = 3):
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=tokens,
                             sampling=SamplingOptions(max_tokens=max_tokens),
                             mm_features=features or None)


class EncoderWorker:
    def __init__(self) -> None:
        self.cache: set[str] = set()
        self.features: dict[str, list[MultiModalFeature]] = {}
        self.computed: dict[str, int] = {}  # identifier -> times the encoder ran on it
        self.computed_tokens: dict[str, int] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for identifier in out.free_encoder_mm_hashes:
            self.cache.discard(identifier)
        for new in out.new_requests:
            self.features[new.request_id] = list(new.mm_features or ())
            self.computed_tokens[new.request_id] = new.num_computed_tokens
        for cached in out.cached_requests:
            self.computed_tokens[cached.request_id] = cached.num_computed_tokens
        for request_id, indices in out.scheduled_encoder_inputs.items():
            for index in indices:
                identifier = self.features[request_id][index].identifier
                assert identifier not in self.cache, f"{identifier} computed again while cached"
                self.cache.add(identifier)
                self.computed[identifier] = self.computed.get(identifier, 0) + 1
        sampled_ids = []
        for request_id, num in out.num_scheduled_tokens.items():
            start = self.computed_tokens[request_id]
            for feature in self.features[request_id]:
                position = feature.position
                if position.offset < start + num and start < position.offset + position.length:
                    assert feature.identifier in self.cache, f"{request_id} reads {feature.identifier}, not cached"
            self.computed_tokens[request_id] = start + num
        return sampled_ids


def run(scheduler: Scheduler, worker: EncoderWorker, *, steps: int = 100) -> list[SchedulerOutput]:
    outputs = []
    for _ in range(steps):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        outputs.append(out)
        worker.execute(out)
        sampled = [rid for rid in out.num_scheduled_tokens if scheduler.sequences[rid].num_pending_tokens]
        scheduler.update_from_output(out, ModelRunnerOutput(request_ids=sampled, sampled_token_ids=[1] * len(sampled)))
    worker.execute(scheduler.schedule())  # the frees of the last step reach the worker with the next
    return outputs


def make_scheduler(*, num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 8,
                   encoder_budget: int | None = None, encoder_cache: int | None = None,
                   prefix_caching: bool = True) -> Scheduler:
    return Scheduler(block_manager=BlockManager(num_blocks, BLOCK, prefix_caching), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, max_model_len=256,
                     max_num_encoder_input_tokens=encoder_budget, encoder_cache_size=encoder_cache)


def assert_empty(scheduler: Scheduler, worker: EncoderWorker) -> None:
    assert scheduler.encoder_cache.num_entries == 0 and scheduler.encoder_cache.num_cached_rows == 0
    assert worker.cache == set()
    assert scheduler.block_manager.usage == 0.0


def test_block_hashes_carry_the_image_identifiers() -> None:
    tokens, features = prompt_with([("X", 6)])  # text 0-4, image 5-10, ...
    same = Sequence(request("a", tokens, features), BLOCK, 0).block_hashes()
    again = Sequence(request("b", tokens, features), BLOCK, 1).block_hashes()
    other = Sequence(request("c", tokens, [image("Y", 5, 6)]), BLOCK, 2).block_hashes()
    text_only = Sequence(request("d", tokens, []), BLOCK, 3).block_hashes()
    assert same == again
    assert same[0] == other[0] == text_only[0]  # tokens 0-3: before the image
    # Every block from the first that holds an image token on differs, the chain carrying it past the image.
    assert all(x != y for x, y in zip(same[1:], other[1:])) and len(same) > 2
    assert all(x != y for x, y in zip(same[1:], text_only[1:]))


def test_same_image_hits_the_prefix_cache_and_a_different_one_never_does() -> None:
    scheduler, worker = make_scheduler(), EncoderWorker()
    tokens, features = prompt_with([("X", 6)], text_after=8)
    scheduler.add_request(request("first", tokens, features))
    run(scheduler, worker)
    scheduler.add_request(request("same", tokens, features))
    scheduler.add_request(request("other", tokens, [image("Y", 5, 6)]))
    hits = {}
    for out in run(scheduler, worker):
        for new in out.new_requests:
            hits[new.request_id] = new.num_computed_tokens
    assert hits["same"] == (len(tokens) - 1) // BLOCK * BLOCK  # every full block, the image's included
    assert hits["other"] == BLOCK  # only the block before the image
    # X was computed for the first request only: the second found its blocks cached and never needed it.
    assert worker.computed == {"X": 1, "Y": 1}
    assert_empty(scheduler, worker)


def test_chunked_prefill_splits_an_image_and_encodes_it_once() -> None:
    scheduler, worker = make_scheduler(budget=8), EncoderWorker()  # an image of 20 rows over chunks of 8
    tokens, features = prompt_with([("X", 20), ("Z", 3)])
    scheduler.add_request(request("a", tokens, features))
    outputs = run(scheduler, worker)
    encoder_steps = [out.scheduled_encoder_inputs for out in outputs if out.scheduled_encoder_inputs]
    assert encoder_steps == [{"a": [0]}, {"a": [1]}]  # each image when its first token is computed
    assert worker.computed == {"X": 1, "Z": 1}
    # X's 20 rows exceed the encoder budget and the cache (8 each): alone in the step and the cache, it runs.
    assert_empty(scheduler, worker)


def test_the_encoder_budget_holds_a_chunk_before_an_image() -> None:
    scheduler, worker = make_scheduler(budget=64, encoder_budget=10), EncoderWorker()
    for request_id in ("a", "b"):
        tokens, features = prompt_with([(f"img-{request_id}", 8)])
        scheduler.add_request(request(request_id, tokens, features))
    first = scheduler.schedule()
    worker.execute(first)
    # a's 8 rows fit the budget of 10; b's would not: b computes its text up to the image only.
    assert first.scheduled_encoder_inputs == {"a": [0]}
    b = next(new for new in first.new_requests if new.request_id == "b")  # (its first block is a's: cached)
    assert b.num_computed_tokens + first.num_scheduled_tokens["b"] == 5
    scheduler.update_from_output(first, ModelRunnerOutput())
    second = scheduler.schedule()
    assert second.scheduled_encoder_inputs == {"b": [0]}
    worker.execute(second)


def test_two_requests_with_one_image_share_one_encoder_run() -> None:
    scheduler, worker = make_scheduler(), EncoderWorker()
    tokens, features = prompt_with([("X", 6)])
    scheduler.add_request(request("a", tokens, features))
    scheduler.add_request(request("b", tokens + [5], features))  # admitted together: no prefix hit yet
    run(scheduler, worker)
    assert worker.computed == {"X": 1}
    assert_empty(scheduler, worker)


@pytest.mark.parametrize("how", ["abort", "preempt"])
def test_abort_and_preemption_free_the_encoder_cache(how: str) -> None:
    # Without the prefix cache a preempted request computes its image again (with it, it may find its blocks).
    scheduler, worker = make_scheduler(num_blocks=14, budget=8, prefix_caching=False), EncoderWorker()
    tokens, features = prompt_with([("X", 12)])
    scheduler.add_request(request("a", tokens, features, max_tokens=20))
    tokens_b, features_b = prompt_with([("Y", 12)], text_before=6)
    scheduler.add_request(request("b", tokens_b, features_b, max_tokens=20))
    out = scheduler.schedule()
    worker.execute(out)
    scheduler.update_from_output(out, ModelRunnerOutput())
    assert scheduler.encoder_cache.num_entries == 1
    if how == "abort":
        scheduler.finish_requests(["a", "b"])
        worker.execute(scheduler.schedule())
        assert_empty(scheduler, worker)
        return
    run(scheduler, worker, steps=200)  # 14 blocks for two requests of up to 11 each: preemptions
    assert scheduler.num_preemptions > 0
    assert worker.computed["X"] + worker.computed["Y"] > 2  # a preempted request's image was computed again
    assert_empty(scheduler, worker)
