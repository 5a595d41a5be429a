"""Stop conditions and streamed text: stop strings across token boundaries, stop ids, EOS,
min_tokens, max_tokens, max_model_len. Tokens are fed directly, so the expected text is exact."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine_fakes import EOS, byte_tokenizer

from vkrt.engine import LLM, SamplingParams
from vkrt.engine.output import OutputProcessor
from vkrt.engine.request import Logprob, Request, RequestOutput, RequestOutputKind, TokenLogprobs

ST, OPX, YZ = 257, 258, 259
KINDS = tuple(RequestOutputKind)


@dataclass
class Fed:
    """One token stream fed to a request of each output kind."""

    cumulative: list[RequestOutput]  # one per token, each with everything so far
    deltas: list[RequestOutput]  # one per token, each with what that token added
    final: RequestOutput  # the FINAL_ONLY request's only output


def feed(tokens: list[int], max_model_len: int = 1000, **params: object) -> Fed:
    """Outputs after each token until the requests finish (they see the same tokens)."""
    processor = OutputProcessor(byte_tokenizer(), max_model_len)
    params.setdefault("max_tokens", None)
    requests = {kind: Request(kind.value, [ord(">")], SamplingParams(**params),  # type: ignore[arg-type]
                              eos_token_ids=(EOS,), output_kind=kind) for kind in KINDS}
    for request in requests.values():
        processor.add(request)
    outputs: dict[RequestOutputKind, list[RequestOutput]] = {kind: [] for kind in KINDS}
    for token in tokens:
        statuses = set()
        for kind, request in requests.items():
            status = processor.append_token(request, token, None)
            if status is not None:
                request.status = status
            statuses.add(status)
            output = processor.make_output(request)
            if output is not None:
                outputs[kind].append(output)
        assert len(statuses) == 1  # the kind never changes when a request stops
        if statuses != {None}:
            break
    [final] = outputs[RequestOutputKind.FINAL_ONLY]  # exactly one, at the end
    assert final.finished
    return Fed(outputs[RequestOutputKind.CUMULATIVE], outputs[RequestOutputKind.DELTA], final)


def text_tokens(text: str) -> list[int]:
    return list(text.encode())


def streamed(fed: Fed) -> str:
    return "".join(o.outputs[0].text for o in fed.deltas)


def test_stop_string_split_over_byte_tokens() -> None:
    fed = feed(text_tokens("abcSTOPdef"), stop="STOP")
    final = fed.final
    assert final.finished and final.finish_reason == "stop" and final.outputs[0].stop_reason == "STOP"
    assert final.text == "abc" and streamed(fed) == "abc"
    assert len(final.token_ids) == 7  # generation ended at the token completing the stop string
    assert all("S" not in o.outputs[0].text for o in fed.deltas)  # a possible start was held back
    assert all("S" not in o.text for o in fed.cumulative)


def test_stop_string_kept_with_include_stop_str_in_output() -> None:
    fed = feed(text_tokens("abcSTOPdef"), stop="STOP", include_stop_str_in_output=True)
    assert fed.final.text == "abcSTOP" and streamed(fed) == "abcSTOP"


def test_stop_string_inside_multi_character_tokens() -> None:
    # "ST" + "OPx": the stop string ends in the middle of the second token; "x" is cut.
    fed = feed([ord("a"), ST, OPX, YZ], stop=["TOP"])
    assert fed.final.text == "aS" and fed.final.outputs[0].stop_reason == "TOP"
    assert streamed(fed) == "aS"
    assert len(fed.deltas) == 3 and len(fed.cumulative) == 3


def test_false_start_is_held_back_then_released() -> None:
    fed = feed(text_tokens("abSTx") + [EOS], stop="STOP")
    deltas = [o.outputs[0].text for o in fed.deltas]
    assert deltas[:5] == ["a", "b", "", "", "STx"]
    assert [o.text for o in fed.cumulative][:5] == ["a", "ab", "ab", "ab", "abSTx"]
    assert fed.final.text == "abSTx" and fed.final.finish_reason == "stop"
    assert fed.final.outputs[0].stop_reason is None  # EOS, not a stop string


def test_earliest_stop_string_wins_and_multibyte_text_is_whole() -> None:
    fed = feed(text_tokens("xé!yz"), stop=["yz", "é!"])
    assert fed.final.text == "x" and fed.final.outputs[0].stop_reason == "é!"
    assert all("\ufffd" not in o.text for o in fed.cumulative + fed.deltas)


def test_a_stop_string_completed_before_min_tokens_does_not_cut_streamed_text() -> None:
    # "xy" is complete at token 2, when min_tokens still forbids stopping, and "abcdef" (the
    # longer stop) keeps the last characters in reach; only a match ending in new text stops.
    fed = feed(text_tokens("xyzqq"), stop=["xy", "abcdef"], min_tokens=4, max_tokens=5)
    assert fed.final.finish_reason == "length"
    assert streamed(fed) == fed.final.text == "xyzqq"
    assert fed.final.outputs[0].stop_reason is None


def test_held_back_text_is_flushed_when_length_ends_the_request() -> None:
    fed = feed(text_tokens("abS"), stop="STOP", max_tokens=3)
    assert fed.final.finish_reason == "length" and streamed(fed) == "abS" == fed.cumulative[-1].text


def test_stop_token_ids_end_without_their_text() -> None:
    fed = feed(text_tokens("abc!def"), stop_token_ids=[ord("!")])
    final = fed.final
    assert final.text == "abc" and final.outputs[0].stop_reason == ord("!")
    assert final.token_ids[-1] == ord("!")


def test_eos_stops_unless_ignored() -> None:
    assert feed(text_tokens("ab") + [EOS, ord("c")]).final.token_ids == [97, 98, EOS]
    ignored = feed(text_tokens("ab") + [EOS, ord("c")], ignore_eos=True, max_tokens=4).final
    assert ignored.token_ids == [97, 98, EOS, 99] and ignored.text == "abc"
    assert ignored.finish_reason == "length"


def test_min_tokens_defers_every_stop_but_length() -> None:
    fed = feed([EOS, ord("S"), ord("T"), ord("O"), ord("P"), EOS], min_tokens=5, stop="STOP")
    # The EOS at token 1 is ignored; "STOP", completed by token 5, counts (5 >= min_tokens).
    assert len(fed.final.token_ids) == 5 and fed.final.outputs[0].stop_reason == "STOP"
    early = feed([EOS, ord("a"), EOS], min_tokens=2)
    assert early.final.token_ids == [EOS, ord("a"), EOS]


def test_max_tokens_and_max_model_len() -> None:
    assert len(feed(text_tokens("abcdefgh"), max_tokens=5).final.token_ids) == 5
    # 1 prompt token + 3 generated = max_model_len 4.
    capped = feed(text_tokens("abcdefgh"), max_model_len=4).final
    assert len(capped.token_ids) == 3 and capped.finish_reason == "length"


def test_deltas_add_up_to_the_cumulative_output_at_every_step() -> None:
    fed = feed(text_tokens("one STOx two STOP three"), stop=["STOP", "xx"])
    assert len(fed.deltas) == len(fed.cumulative) == len(text_tokens("one STOx two STOP"))
    text, ids = "", []
    for delta, snapshot in zip(fed.deltas, fed.cumulative, strict=True):
        assert len(delta.token_ids) == 1  # a delta holds only its own token
        text += delta.text
        ids += delta.token_ids
        assert (text, ids) == (snapshot.text, snapshot.token_ids)
    assert (text, ids) == (fed.final.text, fed.final.token_ids) == ("one STOx two ", text_tokens("one STOx two STOP"))


def test_delta_logprobs_are_the_steps_and_prompt_logprobs_come_once() -> None:
    processor = OutputProcessor(byte_tokenizer(), 1000)
    params = SamplingParams(max_tokens=3, logprobs=0, prompt_logprobs=0)
    delta = Request("d", [1, 2], params, output_kind=RequestOutputKind.DELTA)
    final = Request("f", [1, 2], params, output_kind=RequestOutputKind.FINAL_ONLY)
    scored_prompt = TokenLogprobs(Logprob(2, -0.5, 1))
    entries = [TokenLogprobs(Logprob(t, -float(t), 1)) for t in (97, 98, 99)]
    outputs = []
    for request in (delta, final):
        assert request.prompt_logprobs is not None
        request.prompt_logprobs.append(scored_prompt)
        processor.add(request)
    for entry in entries:
        for request in (delta, final):
            status = processor.append_token(request, entry.token.token_id, entry)
            if status is not None:
                request.status = status
        outputs.append(processor.make_output(delta))
        assert (processor.make_output(final) is None) == (status is None)
    assert [o.outputs[0].logprobs for o in outputs if o] == [[e] for e in entries]
    assert [o.prompt_logprobs for o in outputs if o] == [[None, scored_prompt], None, None]
    assert final.logprobs == entries and final.prompt_logprobs == [None, scored_prompt]


def test_llm_stops_on_eos_min_tokens_and_ignore_eos(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm()
    force_eos = {EOS: 100.0}
    out = llm.generate("hi", SamplingParams(max_tokens=8, logit_bias=force_eos))[0]
    assert out.token_ids == [EOS] and out.finish_reason == "stop" and out.text == ""
    out = llm.generate("hi", SamplingParams(max_tokens=8, logit_bias=force_eos, min_tokens=3))[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == EOS and EOS not in out.token_ids[:3]
    out = llm.generate("hi", SamplingParams(max_tokens=6, logit_bias=force_eos, ignore_eos=True))[0]
    assert out.token_ids == [EOS] * 6 and out.finish_reason == "length"


def test_llm_stream_deltas_add_up_to_the_final_text(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    updates = list(llm.generate_stream("stream me", params))
    final = llm.generate("stream me", params)[0]
    assert updates[-1].finished and not any(u.finished for u in updates[:-1])
    assert "".join(u.outputs[0].text for u in updates) == final.text
    assert [len(u.outputs[0].token_ids) for u in updates] == [1] * 12  # deltas: one new token each
    assert [t for u in updates for t in u.token_ids] == final.token_ids


def test_generated_text_is_decoded_in_the_prompt_s_context(tmp_path: Path) -> None:
    """A SentencePiece vocabulary writes a word's space as the piece's leading "▁", which a
    decoder drops at the start of a text: the first generated word keeps its space only when it
    is decoded after the prompt (Llama 2, Mistral v0.1 and Phi-3 tokenizers; byte-level BPE
    vocabularies such as SmolLM2's read the same either way)."""
    from tests.test_tokenizer import _spm_gguf
    from vkrt.tokenizer import Tokenizer

    vocab = _spm_gguf(tmp_path / "spm.gguf")
    tokenizer = Tokenizer.from_gguf(tmp_path / "spm.gguf")
    processor = OutputProcessor(tokenizer, 100)
    request = Request("r", [1, vocab["▁hello"]], SamplingParams(max_tokens=2), eos_token_ids=(2,))
    processor.add(request)
    for token in (vocab["▁hello"], vocab["▁hello"]):
        processor.append_token(request, token, None)
    output = processor.make_output(request)
    assert output is not None and output.outputs[0].text == " hello hello"
