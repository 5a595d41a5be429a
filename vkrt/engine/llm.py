"""`LLM`: the offline facade. Prompts in, finished outputs (or a stream of updates) out."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

from vkrt.engine.config import EngineConfig, SamplingParams
from vkrt.engine.engine import EngineCore
from vkrt.engine.pooling import PoolingParams, PoolingResult
from vkrt.engine.prompts import Messages, Prompt, encode_prompt, is_single_prompt, render_chat
from vkrt.engine.request import Request, RequestOutput, RequestOutputKind
from vkrt.errors import VkrtError
from vkrt.loader.config import ModelConfig
from vkrt.models.base import CausalLM
from vkrt.tokenizer import Tokenizer


def make_config(config: EngineConfig | str | Path | None, **kwargs: Any) -> EngineConfig:
    """An EngineConfig from a config, a model path or nothing (the default model), plus overrides."""
    if isinstance(config, EngineConfig):
        return dataclasses.replace(config, **kwargs) if kwargs else config
    return EngineConfig(model=config or "", **kwargs)


class LLM:
    """Synchronous generation over the continuous-batching engine.

    `LLM("path/to/model.gguf", device="reference", max_model_len=1024)`; tests may inject an
    already-built `model` (a CausalLM) and `tokenizer` instead of loading from a path.
    """

    def __init__(self, config: EngineConfig | str | Path | None = None, *, model: CausalLM | None = None,
                 tokenizer: Tokenizer | None = None, **kwargs: Any) -> None:
        start = time.perf_counter()
        self.config = make_config(config, **kwargs)
        self.engine = EngineCore.from_config(self.config, model, tokenizer)
        self.load_seconds = time.perf_counter() - start
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the KV event publisher, if the config started one (sending what it has queued)."""
        self.engine.close()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model.config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # ---- generation -----------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; the final outputs in prompt order.

        Every prompt is validated before any is queued, so a bad one raises RequestError with
        nothing run."""
        batch = [cast(Prompt, prompts)] if is_single_prompt(prompts) else cast(Sequence[Prompt], prompts)
        return self._run([encode_prompt(self.tokenizer, p) for p in batch], params)

    def chat(self, messages: Messages | Sequence[Messages], params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or to several."""
        single = len(messages) > 0 and isinstance(messages[0], dict)
        conversations = [cast(Messages, messages)] if single else cast(Sequence[Messages], messages)
        return self._run([render_chat(self.tokenizer, m, chat_template_kwargs=chat_template_kwargs)
                          for m in conversations], params)

    def embed(self, prompts: Prompt | Sequence[Prompt], params: PoolingParams | None = None) -> list[PoolingResult]:
        """Each prompt's pooled final-norm hidden state (not normalised; by default the last token's),
        batched together; with `PoolingParams(logits=True)` also its last logits."""
        batch = [cast(Prompt, prompts)] if is_single_prompt(prompts) else cast(Sequence[Prompt], prompts)
        requests = [self.engine.make_pooling_request(str(next(self._ids)), encode_prompt(self.tokenizer, p)[1],
                                                     params or PoolingParams()) for p in batch]
        results = []
        for output in self._run_requests(requests):
            if output.pooling is None:
                raise VkrtError(output.outputs[0].error or "the pooling request ended without a result")
            results.append(output.pooling)
        return results

    def generate_stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield an update per generated token, the last finished. Each is a delta: its text,
        token ids and logprobs are only what that step added (prompt logprobs come once, in
        the first); join them for the whole output."""
        text, ids = encode_prompt(self.tokenizer, prompt)
        request = self._make(text, ids, params or SamplingParams(), RequestOutputKind.DELTA)
        request_id = request.request_id
        self.engine.add(request)
        finished = False
        try:
            while not finished:
                for output in self.engine.step():
                    if output.request_id == request_id:
                        finished = output.finished
                        yield output
        finally:
            if not finished:
                self.engine.abort(request_id)

    def _make(self, text: str | None, ids: list[int], params: SamplingParams, kind: RequestOutputKind) -> Request:
        return self.engine.make_request(str(next(self._ids)), ids, params, prompt=text, output_kind=kind)

    def _run(self, prompts: list[tuple[str | None, list[int]]],
             params: SamplingParams | Sequence[SamplingParams] | None) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
        # All made (validated) before any is queued: a bad prompt fails the call with nothing run.
        requests = [self._make(text, ids, p, RequestOutputKind.FINAL_ONLY)
                    for (text, ids), p in zip(prompts, per_prompt, strict=True)]
        return self._run_requests(requests)

    def _run_requests(self, requests: list[Request]) -> list[RequestOutput]:
        """Queue the requests, step until all finish; their final outputs in order."""
        for request in requests:
            self.engine.add(request)
        order = [request.request_id for request in requests]
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(order):
                for output in self.engine.step():
                    if output.finished:
                        final[output.request_id] = output
        finally:
            for request_id in order:
                if request_id not in final:
                    self.engine.abort(request_id)
        return [final[request_id] for request_id in order]

    # ---- stats ----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Load time, prefill/decode tok/s, and average device counters per decode step."""
        totals = self.engine.totals
        last = self.engine.runner.last_step
        return {
            "load_seconds": self.load_seconds,
            "steps": totals.steps,
            "prompt_tokens": totals.prompt_tokens,
            "generation_tokens": totals.generation_tokens,
            "prefill_tokens_per_second": totals.prefill_tokens_per_second,
            "decode_tokens_per_second": totals.decode_tokens_per_second,
            "decode_steps": totals.decode_steps,
            "decode_seconds": totals.decode_seconds,
            "counters_total": dict(totals.counters),
            "decode_counters_per_step": totals.decode_counters_per_step(),
            "decode_counters_max": dict(totals.decode_counters_max),
            "last_step": dataclasses.asdict(last),
            "num_preemptions": self.engine.num_preemptions,
            "kv_blocks": self.engine.block_manager.num_blocks,
        } | ({"speculative": totals.spec.as_dict()} if self.config.speculative is not None else {})
