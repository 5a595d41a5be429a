"""A deterministic stand-in for AsyncLLM: byte tokens, letters as output, no model.

It follows AsyncLLM's contract (generate / abort / metrics / is_ready), so server logic is
tested without loading a model: `generate` makes the request through the engine's own
RequestProcessor (so the server sees the engine's errors) and streams delta outputs, text
that may start a stop string held back as the engine holds it. Output token i is the letter
'a' + (i % 26), one per step of `step_delay` seconds.

With a `script` the output is the script's tokens instead (its bytes, "<eos>" the EOS token),
then EOS (a token of `stop_token_ids` ends it too, its text left out, as the engine does); and
an output constraint is applied for real, as the engine applies it: the
grammar is compiled by llguidance over the byte vocabulary, a script token the grammar's mask
refuses is skipped (the scripted "model" would have written it, the mask prevents it), once
the script is spent the first token the mask allows is taken (EOS when it may end), and the
request stops when the grammar is complete. `script` may also be a function of the request's
SamplingParams, to script each request differently.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import numpy as np

from vkrt.chat_template import ChatTemplate, TemplateBudget
from vkrt.engine.async_llm import EngineMetrics
from vkrt.engine.config import SamplingParams
from vkrt.engine.guided import GrammarCompiler, Guide
from vkrt.engine.pooling import PoolingParams, PoolingResult
from vkrt.engine.processor import RequestProcessor
from vkrt.engine.request import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from vkrt.loader.config import ModelConfig

EOS = 256
SPECIALS = {256: "<eos>", 257: "<|im_start|>", 258: "<|im_end|>",
            # gpt-oss's harmony markers (vkrt/server/harmony.py)
            259: "<|start|>", 260: "<|channel|>", 261: "<|message|>", 262: "<|end|>", 263: "<|return|>",
            264: "<|call|>", 265: "<|constrain|>",
            # Seed-OSS's think and tool-call tags (vkrt/server/reasoning.py, tool_xml.py)
            266: "<seed:think>", 267: "</seed:think>", 268: "<seed:tool_call>", 269: "</seed:tool_call>",
            # Hermes's and Mistral's call tags, special tokens in some vocabularies (vkrt/server/tools.py)
            270: "<tool_call>", 271: "</tool_call>", 272: "[TOOL_CALLS]",
            # Qwen2.5-Coder's fill-in-the-middle tokens (vkrt/server/infill.py)
            273: "<|fim_prefix|>", 274: "<|fim_suffix|>", 275: "<|fim_middle|>", 276: "<|repo_name|>",
            277: "<|file_sep|>"}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class FakeTokenizer:
    """Bytes are tokens 0..255; the special tokens above them; a ChatML template rendered
    by the real ChatTemplate (so its budget and errors are the server's)."""

    eos_token_ids = (EOS,)
    vocab_size = 256 + len(SPECIALS)

    fim_token_ids = {"prefix": 273, "suffix": 274, "middle": 275, "repo": 276, "file_sep": 277}

    def __init__(self, chat_template: str = CHATML) -> None:
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._encode(text, specials=True)

    def encode_as_text(self, text: str) -> list[int]:
        return self._encode(text, specials=False)

    def _encode(self, text: str, specials: bool) -> list[int]:
        ids: list[int] = []
        rest = text
        while rest:
            special = next((i for i, s in SPECIALS.items() if rest.startswith(s)), None) if specials else None
            if special is not None:
                ids.append(special)
                rest = rest[len(SPECIALS[special]):]
            else:
                ids.extend(rest[0].encode())
                rest = rest[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, pending = [], bytearray()
        for i in ids:
            if i < 256:
                pending.append(i)
                continue
            out.append(pending.decode(errors="replace"))
            pending = bytearray()
            if not skip_special_tokens:
                out.append(SPECIALS[i])
        out.append(pending.decode(errors="replace"))
        return "".join(out)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def token_piece(self, token_id: int) -> str:
        return self.token_text(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else SPECIALS[token_id].encode()

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: Any = None, budget: TemplateBudget | None = None, **kwargs: Any) -> str:
        self.last_template_kwargs = kwargs
        return ChatTemplate(self.chat_template).render(messages, add_generation_prompt=add_generation_prompt,
                                                       tools=tools, budget=budget, template_kwargs=kwargs)


class ByteGrammarCompiler(GrammarCompiler):
    """The engine's GrammarCompiler over the fake's byte vocabulary (llguidance indexes it
    from the token bytes, as it indexes a real tokenizer from its JSON)."""

    def __init__(self) -> None:
        super().__init__(None, FakeTokenizer.vocab_size, (EOS,))

    def _llg_tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                import llguidance
                from llguidance._tokenizer import TokenizerWrapper

                class Bytes:
                    eos_token_id, bos_token_id = EOS, None
                    tokens = [bytes([i]) for i in range(256)] + [s.encode() for s in SPECIALS.values()]
                    special_token_ids = list(SPECIALS)

                    def __call__(self, text: bytes) -> list[int]:
                        return list(text)

                self._ll_tokenizer = llguidance.LLTokenizer(TokenizerWrapper(Bytes()), n_vocab=self.vocab_size,
                                                            eos_token=[EOS])
            return self._ll_tokenizer


Script = str | Callable[[SamplingParams], str]


class FakeEngine:
    """AsyncLLM's interface over a scripted token stream."""

    def __init__(self, max_model_len: int = 64, step_delay: float = 0.0, ready: bool = True,
                 script: Script | None = None) -> None:
        self.tokenizer = FakeTokenizer()
        self.script = script
        self.grammars = ByteGrammarCompiler()
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.ready = ready
        self.load_error: BaseException | None = None
        self.fail_with: BaseException | None = None  # raised by generate after `fail_after` tokens
        self.fail_after = 0
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.requests: list[tuple[str, list[int], SamplingParams, str | None]] = []
        self.num_preemptions = 0
        self.generation_tokens = 0

    @property
    def is_ready(self) -> bool:
        return self.ready

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                 *, prompt_text: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if self.script is None:
            # Letters as output: a grammar is checked for form only (they would not follow it).
            processor = RequestProcessor(self.tokenizer.vocab_size, self.max_model_len, (EOS,),
                                         GrammarCompiler(None, self.tokenizer.vocab_size, (EOS,)))
            if params.guided_decoding is not None:
                params.guided_decoding.validate()
            processor.make_request(request_id or "fake", ids, dataclasses.replace(params, guided_decoding=None))
            return self._stream(request_id or "fake", ids, params, prompt_text)
        processor = RequestProcessor(self.tokenizer.vocab_size, self.max_model_len, (EOS,), self.grammars)
        request = processor.make_request(request_id or "fake", ids, params)
        script = self.script(params) if callable(self.script) else self.script
        return self._stream(request_id or "fake", ids, params, prompt_text, script, request.guide)

    def _next_token(self, num_tokens: int, script: list[int] | None, guide: Guide | None) -> int:
        """The token of step `num_tokens`: a letter, or the script's next one the grammar allows."""
        if script is None:
            return ord("a") + num_tokens % 26
        if guide is None:
            return script.pop(0) if script else EOS
        mask = np.empty(self.grammars.words, np.uint32)
        guide.fill_mask(mask)

        def allowed(token: int) -> bool:
            return bool(mask[token // 32] >> np.uint32(token % 32) & np.uint32(1))

        while script:
            token = script.pop(0)
            if allowed(token):
                return token
        return EOS if allowed(EOS) else next(t for t in range(self.tokenizer.vocab_size) if allowed(t))

    async def _stream(self, rid: str, ids: list[int], params: SamplingParams, prompt_text: str | None,
                      script_text: str | None = None,
                      guide: Guide | None = None) -> AsyncGenerator[RequestOutput, None]:
        script = None if script_text is None else self.tokenizer.encode(script_text)
        out_ids: list[int] = []
        self.requests.append((rid, ids, params, prompt_text))
        self.active.add(rid)
        num_tokens = 0
        text, sent = "", 0
        finished = False
        try:
            max_tokens = params.max_tokens or self.max_model_len - len(ids)
            while not finished:
                await asyncio.sleep(self.step_delay)
                if self.fail_with is not None and num_tokens >= self.fail_after:
                    raise self.fail_with
                token = self._next_token(num_tokens, script, guide)
                num_tokens += 1
                self.generation_tokens += 1
                logprobs = None
                if params.logprobs is not None:
                    top = [Logprob(token, -0.25, 1), Logprob(token + 1, -1.5, 2), Logprob(token + 2, -3.0, 3)]
                    logprobs = [TokenLogprobs(Logprob(token, -0.25, 1), top[: params.logprobs])]
                reason, stop_reason = None, None
                if script is None:
                    text += chr(token)
                else:
                    if guide is not None and not guide.advance(token):
                        raise AssertionError(f"the grammar refused token {token}, which its mask allowed")
                    if token == EOS:
                        reason = "stop"
                    elif token in params.stop_token_ids:
                        reason, stop_reason = "stop", token
                    else:
                        out_ids.append(token)
                    text = self.tokenizer.decode(out_ids, skip_special_tokens=params.skip_special_tokens)
                # As the engine decides: EOS, a stop string, max_tokens, then a complete grammar.
                stop = None if reason else next((s for s in params.stop_strings if s in text), None)
                if stop is not None:
                    text = text[: text.index(stop) + (len(stop) if params.include_stop_str_in_output else 0)]
                    reason, stop_reason = "stop", stop
                elif reason is None and num_tokens >= max_tokens:
                    reason = "length"
                elif reason is None and guide is not None and guide.is_complete:
                    reason = "stop"
                finished = reason is not None
                end = len(text) if finished else len(text) - _held_back(text, params.stop_strings)
                delta, sent = text[sent:end], max(sent, end)
                yield RequestOutput(rid, prompt_text, ids, [CompletionOutput(
                    0, delta, [token], logprobs=logprobs, finish_reason=reason, stop_reason=stop_reason)], finished)
        finally:
            if not finished:
                self.abort(rid)
            self.active.discard(rid)

    @property
    def model_config(self) -> ModelConfig:
        """A generative model of the byte vocabulary with 8-dimensional hidden states."""
        return ModelConfig(architecture="fake", vocab_size=self.tokenizer.vocab_size, hidden_size=8,
                           intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8)

    async def pool(self, prompt_token_ids: list[int], params: PoolingParams,
                   request_id: str | None = None) -> PoolingResult:
        """The prompt's token counts modulo 8 (plus one) as its pooled state; its last token as logits."""
        processor = RequestProcessor(self.tokenizer.vocab_size, self.max_model_len, (EOS,),
                                     GrammarCompiler(None, self.tokenizer.vocab_size, (EOS,)))
        processor.make_pooling_request(request_id or "fake", prompt_token_ids, params)
        await asyncio.sleep(self.step_delay)
        embedding = np.bincount(np.asarray(prompt_token_ids) % 8, minlength=8).astype(np.float32) + 1
        logits = np.eye(self.tokenizer.vocab_size, dtype=np.float32)[prompt_token_ids[-1]] if params.logits else None
        return PoolingResult(embedding, logits, len(prompt_token_ids))

    def abort(self, request_id: str) -> None:
        if request_id in self.active:
            self.aborted.append(request_id)
            self.active.discard(request_id)

    def metrics(self) -> EngineMetrics:
        return EngineMetrics(num_running=len(self.active), num_waiting=0, kv_usage=len(self.active) / 8,
                             num_kv_blocks=8, num_free_kv_blocks=8 - len(self.active),
                             num_preemptions=self.num_preemptions, generation_tokens=self.generation_tokens,
                             last_step_counters={"dispatches": 7, "submits": 1, "drains": 0})


def _held_back(text: str, stops: list[str]) -> int:
    """How much of the end of `text` may start a stop string (held back, as the engine does)."""
    longest = max((len(stop) for stop in stops), default=0)
    return next((k for k in range(min(len(text), longest - 1), 0, -1)
                 if any(stop.startswith(text[-k:]) for stop in stops)), 0)
