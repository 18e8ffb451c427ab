"""Vision-language models on the engine (issue 38, the engine and worker side): Idefics3 (and transformers'
SmolVLM classes, the same layout) and LLaVA, tiny random
checkpoints with their real transformers processors, greedy tokens identical to transformers' generate for
prompts with one image and with two of different sizes.

The prompts go in as the frontend will send them (EngineCoreRequest with mm_features, built here from the HF
processor: tests/support/vision_models.py), through a whole in-process engine: scheduler, encoder budget and
cache, worker, model. Each engine's step budget is smaller than an image's placeholder run, so every image is
split across chunks (checked), and the later chunks read its cached embeddings. Also: the same image again hits
the prefix cache through the image's blocks, the same text with another image does not; preemption and TP=2
(LLaVA, two worker processes, a KV cache too small for its requests at once) still match; the KV cache and the
encoder cache are empty after every request.
"""

from __future__ import annotations

from contextlib import aclosing

import anyio
import msgspec
import pytest
import torch
from anyio.from_thread import start_blocking_portal

from asyncengine import AsyncEngine, EngineConfig, SamplingParams
from asyncengine.frontend.output_processor import OutputKind

from support.vision_models import PreparedPrompt, TinyVLM, build_idefics3, build_llava, images, prepare

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
PROMPTS = {
    "idefics3": ("User:<image>What is this?", "User:<image>Compare<image>them."),
    "smolvlm": ("User:<image>What is this?", "User:<image>Compare<image>them."),
    "llava": ("USER: <image> what is this?", "USER: <image> and <image> compare them."),
}
BUDGET = {"idefics3": 24, "smolvlm": 24, "llava": 8}  # tokens per step: less than one image's placeholder run


class Engine:
    """An in-process AsyncEngine on a thread of its own, fed prepared multimodal prompts."""

    def __init__(self, portal, engine: AsyncEngine) -> None:
        self.portal, self.engine = portal, engine

    def generate(self, prompts: list[PreparedPrompt], max_tokens: int = MAX_TOKENS) -> list:
        async def run_all() -> list:
            outputs: list = [None] * len(prompts)

            async def one(index: int) -> None:
                processed = self.engine.process_request({"prompt_token_ids": prompts[index].token_ids},
                                                        SamplingParams(temperature=0.0, max_tokens=max_tokens))
                processed.children = [msgspec.structs.replace(child, mm_features=prompts[index].features)
                                      for child in processed.children]
                async for output in self.engine.submit(processed, OutputKind.FINAL_ONLY):
                    outputs[index] = output

            async with anyio.create_task_group() as tg:
                for index in range(len(prompts)):
                    tg.start_soon(one, index)
            return outputs

        return self.portal.call(run_all)

    def abort_after_first_output(self, prompts: list[PreparedPrompt]) -> None:
        """Stream the prompts at once; at the first output of any, stop consuming all of them: the engine aborts
        each wherever it is (the others mid-prefill, some inside an image's span)."""
        async def run_all() -> None:
            async def one(prompt: PreparedPrompt, scope: anyio.CancelScope) -> None:
                processed = self.engine.process_request({"prompt_token_ids": prompt.token_ids},
                                                        SamplingParams(temperature=0.0, max_tokens=100))
                processed.children = [msgspec.structs.replace(child, mm_features=prompt.features)
                                      for child in processed.children]
                async with aclosing(self.engine.submit(processed, OutputKind.DELTA)) as outputs:
                    async for _ in outputs:
                        scope.cancel()

            async with anyio.create_task_group() as tg:
                for prompt in prompts:
                    tg.start_soon(one, prompt, tg.cancel_scope)
            with anyio.fail_after(30):  # the aborts reach the engine core after the consumers left
                while (await self.engine.get_scheduler_stats()).num_running_reqs:
                    await anyio.sleep(0.05)

        self.portal.call(run_all)

    def stats(self):
        return self.portal.call(self.engine.get_scheduler_stats)


@pytest.fixture(scope="module", params=["idefics3", "smolvlm", "llava"])
def vlm(request, default_model_dir, tmp_path_factory) -> TinyVLM:
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "llava":
        return build_llava(directory, default_model_dir)
    return build_idefics3(directory, default_model_dir, arch={"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[request.param])


@pytest.fixture(scope="module")
def engine(vlm):
    config = EngineConfig(model=str(vlm.path), max_model_len=256, num_gpu_blocks_override=48, block_size=8,
                          max_num_batched_tokens=BUDGET[vlm.name], plugins="")
    with start_blocking_portal(backend="trio") as portal:
        with portal.wrap_async_context_manager(AsyncEngine.start(config)) as started:
            yield Engine(portal, started)


def hf_greedy(vlm: TinyVLM, prompt: PreparedPrompt, max_tokens: int = MAX_TOKENS) -> list[int]:
    with torch.inference_mode():
        out = vlm.hf_model.generate(**prompt.hf_inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt.token_ids):].tolist()


def assert_idle(engine: Engine) -> None:
    stats = engine.stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_running_reqs == 0
    assert stats.encoder_cache_entries == 0 and stats.encoder_cache_rows == 0


def test_greedy_tokens_match_transformers_with_one_and_two_images_split_across_chunks(vlm, engine):
    one_text, two_text = PROMPTS[vlm.name]
    first, second = images(seed=1)
    prompts = [prepare(vlm, one_text, [first]), prepare(vlm, two_text, [first, second])]
    budget = BUDGET[vlm.name]
    for prompt in prompts:  # alone in the engine, a prompt's chunks start at multiples of the budget
        assert any(feature.position.offset < k * budget < feature.position.offset + feature.position.length
                   for feature in prompt.features for k in range(1, 40)), "no image is split across chunks"
    outputs = engine.generate(prompts)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(vlm, prompt)
    assert_idle(engine)


def test_the_same_image_hits_the_prefix_cache_and_another_image_does_not(vlm, engine):
    text = PROMPTS[vlm.name][0]
    first, second = images(seed=2)
    same, other = prepare(vlm, text, [first]), prepare(vlm, text, [second])
    [warm] = engine.generate([same])
    [again] = engine.generate([same])
    [different] = engine.generate([other])
    image_offset = same.features[0].position.offset
    assert again.num_cached_tokens > image_offset + same.features[0].position.length - 8  # through the image
    assert different.num_cached_tokens <= image_offset  # only the text before the image
    assert again.outputs[0].token_ids == warm.outputs[0].token_ids == hf_greedy(vlm, same)
    assert different.outputs[0].token_ids == hf_greedy(vlm, other)
    assert_idle(engine)


def test_aborted_requests_leave_no_kv_blocks_and_no_encoder_cache_entries(vlm, engine):
    pictures = images(seed=5)
    prompts = [prepare(vlm, PROMPTS[vlm.name][0], pictures[:1]), prepare(vlm, PROMPTS[vlm.name][1], pictures),
               prepare(vlm, PROMPTS[vlm.name][1], pictures[::-1])]
    engine.abort_after_first_output(prompts)
    assert_idle(engine)


def test_preemption_and_tensor_parallel_2_still_match(vlm):
    if vlm.name != "llava":
        pytest.skip("preemption and TP=2 are checked on one architecture (LLaVA)")
    # Two worker processes (the language model sharded, the vision tower on each rank), 12 blocks of 8 tokens;
    # each request grows to ~60 tokens (8 blocks): three at once must preempt, and without the prefix cache a
    # preempted request computes its images again.
    config = EngineConfig(model=str(vlm.path), max_model_len=96, num_gpu_blocks_override=12, block_size=8,
                          max_num_batched_tokens=16, enable_prefix_caching=False, tensor_parallel_size=2,
                          plugins="")
    pictures = images(seed=3)
    prompts = [prepare(vlm, PROMPTS["llava"][1], [pictures[i % 2], pictures[(i + 1) % 2]]) for i in range(3)]
    with start_blocking_portal(backend="trio") as portal:
        with portal.wrap_async_context_manager(AsyncEngine.start(config)) as started:
            engine = Engine(portal, started)
            outputs = engine.generate(prompts, max_tokens=20)
            assert engine.stats().num_preemptions > 0
            for prompt, output in zip(prompts, outputs):
                assert output.outputs[0].token_ids == hf_greedy(vlm, prompt, 20)
            assert_idle(engine)
