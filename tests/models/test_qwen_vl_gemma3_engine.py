"""Qwen2-VL, Qwen2.5-VL and Gemma 3 with images through a whole in-process engine (scheduler, encoder cache,
worker, M-RoPE positions in the model runner): greedy tokens identical to transformers' generate for prompts
with one image and with two of different sizes, and each token's log-probability within 1e-3. The prompts go in as the frontend sends them (token ids and
one MultiModalFeature per image, built with the real image processors: tests/support/vl_models.py).

The Qwen engines take 5 tokens a step, fewer than any image's placeholder run: every image is split across
chunks, so the later chunks read the image's 3-D positions from the table kept per request and its cached
embeddings; the decoded tokens continue the positions by the prompt's delta. Gemma 3's step holds a whole
image (its image tokens attend to each other both ways within a step: asyncengine/models/gemma3_mm.py)."""

from __future__ import annotations

import anyio
import msgspec
import pytest
from anyio.from_thread import start_blocking_portal

from asyncengine import AsyncEngine, EngineConfig, SamplingParams
from asyncengine.errors import RequestError
from asyncengine.frontend.output_processor import OutputKind
from asyncengine.wire.multimodal import PlaceholderRange

from support import vl_models as vl

pytest.importorskip("PIL")
pytestmark = pytest.mark.slow  # the default model's tokenizer (default_model_dir)

MAX_TOKENS = 8
LOGPROB_ATOL = 1e-3  # float32 on both sides: paged attention and fused projections sum in another order
BUDGET = {"qwen2_vl": 5, "qwen2_5_vl": 5, "gemma3": 64}
TEXT = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15]]


async def one(engine: AsyncEngine, prompt: vl.Prepared) -> object:
    """The final output of `prompt` sent as the frontend sends it (token ids, then its features)."""
    processed = engine.process_request({"prompt_token_ids": prompt.token_ids},
                                       SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                      logprobs=0))
    processed.children = [msgspec.structs.replace(child, mm_features=prompt.features) for child in processed.children]
    final = None
    async for output in engine.submit(processed, OutputKind.FINAL_ONLY):
        final = output
    return final


def run(engine: AsyncEngine, prompts: list[vl.Prepared]) -> object:
    """All of `prompts` at once; their final outputs in order."""
    async def run_all() -> list:
        outputs: list = [None] * len(prompts)

        async def into(index: int) -> None:
            outputs[index] = await one(engine, prompts[index])

        async with anyio.create_task_group() as tg:
            for index in range(len(prompts)):
                tg.start_soon(into, index)
        return outputs

    return run_all


async def from_text(engine: AsyncEngine, pictures: list) -> tuple[list[int], list[int]]:
    """(prompt token ids, generated tokens) of a text prompt with Qwen's image placeholders and its images as
    multi_modal_data: the frontend's processing (asyncengine/models/qwen2_vl_processing.py)."""
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    prompt_ids: list[int] = []
    generated: list[int] = []
    async for output in engine.generate({"prompt": f"Look at{placeholder} and{placeholder} now",
                                         "multi_modal_data": {"image": pictures}},
                                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)):
        prompt_ids = list(output.prompt_token_ids or prompt_ids)
        generated += output.outputs[0].token_ids
    return prompt_ids, generated


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "gemma3"])
def test_greedy_tokens_match_transformers_with_one_and_two_images(name, tmp_path, default_model_dir):
    vlm = vl.save(name, tmp_path, default_model_dir)
    pictures = vl.two_images()
    prompts = [vl.prepare(vlm, pictures[:1], TEXT[:2]), vl.prepare(vlm, pictures, TEXT)]
    if name != "gemma3":  # every image is split across steps
        assert all(feature.position.length > BUDGET[name] for p in prompts for feature in p.features)
    config = EngineConfig(model=str(tmp_path), max_model_len=128, block_size=8,
                          num_gpu_blocks_override=96, max_num_batched_tokens=BUDGET[name], plugins="")
    with start_blocking_portal(backend="trio") as portal:
        with portal.wrap_async_context_manager(AsyncEngine.start(config)) as engine:
            outputs = portal.call(run(engine, prompts))
            through_frontend = portal.call(from_text, engine, pictures) if name == "qwen2_vl" else None
            if name == "qwen2_vl":  # misplaced images fail their request, not the engine: past the prompt's end,
                # or the second over the first (which the model's positions refuse)
                first, second = prompts[1].features
                for moved in (first.position.offset + 1, len(prompts[1].token_ids) - 2):
                    misplaced = msgspec.structs.replace(second, position=PlaceholderRange(
                        offset=moved, length=second.position.length))
                    with pytest.raises(RequestError, match="placeholder"):
                        portal.call(one, engine, vl.Prepared(prompts[1].token_ids, [first, misplaced], {}))
                again = portal.call(run(engine, prompts[:1]))[0]
                assert again.outputs[0].token_ids == outputs[0].outputs[0].token_ids
            stats = portal.call(engine.get_scheduler_stats)
    for prompt, output in zip(prompts, outputs):
        tokens, logprobs = vl.hf_greedy(vlm, prompt, MAX_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        ours = [entry[token] for entry, token in zip(completion.logprobs, tokens)]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < LOGPROB_ATOL
    if name == "gemma3":  # causal attention over the image tokens would be told apart by the logprobs above
        _, causal = vl.hf_greedy(vlm, prompts[1], 1, without=("token_type_ids",))
        assert abs(causal[0] - vl.hf_greedy(vlm, prompts[1], 1)[1][0]) > 10 * LOGPROB_ATOL
    if through_frontend is not None:  # each image's pad expanded to its merged patches, tokens as transformers'
        prompt_ids, generated = through_frontend
        assert prompt_ids.count(vlm.tokens.image) == sum(f.position.length for f in prompts[1].features)
        processed = [vlm.image_processor(images=[picture], return_tensors="pt") for picture in pictures]
        reference = vl.Prepared(prompt_ids, [], vl.transformers_inputs(vlm, prompt_ids, processed))
        assert generated == vl.hf_greedy(vlm, reference, MAX_TOKENS)[0]
    assert stats.kv_cache_usage == 0.0 and stats.num_running_reqs == 0
