"""POST /infill: llama-server's fill-in-the-middle, what editor plugins (llama.vscode) call.

The prompt is laid out as llama-server lays it out, in the repository-level form Qwen2.5-Coder
was trained on, with the model's own FIM tokens (the tokenizer finds them: GGUF keys, or their
spelling in the vocabulary):

    <|repo_name|>myproject\\n
    <|file_sep|>{filename}\\n{text}           one per input_extra file
    <|file_sep|>filename\\n                   the file being edited (its name is not sent)
    <|fim_prefix|>{input_prefix}{prompt}<|fim_suffix|>{input_suffix}<|fim_middle|>

A vocabulary without the repository or file-separator tokens gets the files as text, each after
a "--- snippet ---" line. Every text piece is tokenised on its own, special-token text as text.
When the prompt does not fit the context (less the tokens to generate), the project files go
first, from their start; then the prefix loses its start and the suffix its end, the suffix
keeping at most a quarter of the room unless the prefix needs less. The reply is llama-server's
own shape, not OpenAI's: `content`, then the stop and token counts; streamed, one
`{"content", "stop": false}` event per update and a last one with `stop: true` and the counts.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vkrt.errors import RequestError
from vkrt.server.choices import (
    CandidateSet,
    merged_updates,
    open_candidates,
    run_all,
    start_candidates,
)
from vkrt.server.engine_client import require_tokenizer
from vkrt.server.errors import APIError
from vkrt.server.generation import Result, ServerState, raise_if_failed
from vkrt.server.middleware import request_id_of
from vkrt.server.prompts import check_prompt_chars, check_text_fields
from vkrt.server.protocol import InfillRequest
from vkrt.server.responses import check_model, event_stream, log_request, new_response_id, sse
from vkrt.server.sampling import check_unsupported, field_error, sampling_params
from vkrt.tokenizer import Tokenizer

# What llama-server writes where the request has no name: the project, the file being edited.
_PROJECT_LINE = "myproject\n"
_CURRENT_FILE_LINE = "filename\n"
_SNIPPET_LINE = "\n\n--- snippet ---\n\n"  # before each file, for a vocabulary without <|file_sep|>
_SUFFIX_SHARE = 4  # the suffix keeps 1/4 of the room a cut leaves, unless the prefix needs less


def infill_prompt(tokenizer: Tokenizer, body: InfillRequest, room: int) -> tuple[list[int], bool]:
    """The infill prompt's ids within `room` tokens, and whether anything was cut (CPU work)."""
    fim = tokenizer.fim_token_ids
    missing = [role for role in ("prefix", "suffix", "middle") if role not in fim]
    if missing:
        raise APIError(400, "this model has no fill-in-the-middle tokens (no <|fim_prefix|>, <|fim_suffix|> and "
                       "<|fim_middle|>, nor GGUF keys naming them): /infill needs a code model trained for it, "
                       "such as Qwen2.5-Coder; use /v1/completions instead", param="input_prefix",
                       code="infill_not_supported")
    text = tokenizer.encode_as_text
    project: list[int] = [fim["repo"], *text(_PROJECT_LINE)] if "repo" in fim else []
    for chunk in body.input_extra:
        head = [fim["file_sep"], *text(chunk.filename + "\n")] if "file_sep" in fim else text(_SNIPPET_LINE)
        project += head + text(chunk.text)
    if "file_sep" in fim:
        project += [fim["file_sep"], *text(_CURRENT_FILE_LINE)]
    start = tokenizer.encode("", add_special_tokens=True)  # the BOS a prompt starts with, if any
    prefix, prompt, suffix = text(body.input_prefix), text(body.prompt), text(body.input_suffix)

    left = room - len(start) - 3 - len(prompt)  # 3: the prefix, suffix and middle tokens
    keep_suffix = max(0, min(len(suffix), max(left // _SUFFIX_SHARE, left - len(prefix))))
    keep_prefix = max(0, min(len(prefix), left - keep_suffix))
    keep_project = max(0, min(len(project), left - keep_prefix - keep_suffix))
    cut = (keep_prefix, keep_suffix, keep_project) != (len(prefix), len(suffix), len(project))
    ids = [*start, *project[len(project) - keep_project:], fim["prefix"], *prefix[len(prefix) - keep_prefix:],
           *prompt, fim["suffix"], *suffix[:keep_suffix], fim["middle"]]
    return ids, cut


async def create_infill(state: ServerState, body: InfillRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    check_model(state, body.model)
    engine = state.require_engine()
    check_unsupported(body)
    if body.n != 1:
        raise APIError(400, f"n: /infill answers one completion, got n={body.n}", param="n", code="invalid_value")
    if body.n_predict is not None and body.n_predict < -1:
        raise APIError(400, f"n_predict: must be -1 (until the context is full) or >= 1, got {body.n_predict}",
                       param="n_predict", code="invalid_value")
    texts = [body.input_prefix, body.input_suffix, body.prompt, *(chunk.text for chunk in body.input_extra)]
    check_prompt_chars(sum(map(len, texts)), state.config.max_prompt_chars, "input_prefix")
    check_text_fields(body)
    params = sampling_params(body, state.config.max_digits())
    room = engine.max_model_len - (params.max_tokens or 1)
    tokenizer = require_tokenizer(engine, "input_prefix")
    prompt_ids, truncated = await state.run_cpu(infill_prompt, tokenizer, body, room)
    response_id = new_response_id("cmpl")
    try:
        opened = await open_candidates(state, response_id, [(prompt_ids, None)], [params], 1)
    except RequestError as exc:
        raise field_error(exc, body, "input_prefix") from exc
    candidates = start_candidates(state, response_id, opened, arrival)
    log_request(state, response_id, request_id_of(raw.state), None, prompt_ids, params)
    if body.stream:  # llama-server's own streams end without [DONE]
        return event_stream(_stream(state, candidates, truncated), candidates, done=b"")
    [[result]] = await run_all(candidates.groups, raw)
    raise_if_failed(result)
    return JSONResponse({"content": result.text, **_summary(state, result, truncated)})


def _summary(state: ServerState, result: Result, truncated: bool) -> dict[str, Any]:
    """llama-server's closing fields: why it stopped, and the token counts."""
    if result.finish_reason == "length":
        stop_type, word = "limit", ""
    elif isinstance(result.stop_reason, str):
        stop_type, word = "word", result.stop_reason
    else:  # EOS, or a stop token id, which llama-server also reads as an end of generation
        stop_type, word = "eos", ""
    return {"stop": True, "model": state.model_name, "stop_type": stop_type, "stopping_word": word,
            "tokens_predicted": len(result.token_ids), "tokens_evaluated": len(result.prompt_token_ids),
            "tokens_cached": result.num_cached_tokens, "truncated": truncated}


async def _stream(state: ServerState, candidates: CandidateSet, truncated: bool) -> AsyncIterator[bytes]:
    [[generation]] = candidates.groups
    async for _, update in merged_updates(candidates.groups):
        if update.text:
            yield sse({"content": update.text, "stop": False})
    raise_if_failed(generation.result)
    yield sse({"content": "", **_summary(state, generation.result, truncated)})
