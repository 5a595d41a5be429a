"""Stop conditions and streamed text: stop strings across token boundaries, stop ids, EOS,
min_tokens, max_tokens, max_model_len. Tokens are fed directly, so the expected text is exact."""

from __future__ import annotations

from collections.abc import Callable

from engine_fakes import EOS, byte_tokenizer

from vkrt.engine import LLM, SamplingParams
from vkrt.engine.output import OutputProcessor
from vkrt.engine.request import Request, RequestOutput

ST, OPX, YZ = 257, 258, 259


def feed(tokens: list[int], max_model_len: int = 1000, **params: object) -> list[RequestOutput]:
    """Outputs after each token until the request finishes."""
    processor = OutputProcessor(byte_tokenizer(), max_model_len)
    params.setdefault("max_tokens", None)
    request = Request("r", [ord(">")], SamplingParams(**params), eos_token_ids=(EOS,))  # type: ignore[arg-type]
    processor.add(request)
    outputs = []
    for token in tokens:
        status = processor.append_token(request, token, None)
        if status is not None:
            request.status = status
        outputs.append(processor.make_output(request))
        if status is not None:
            break
    return outputs


def text_tokens(text: str) -> list[int]:
    return list(text.encode())


def streamed(outputs: list[RequestOutput]) -> str:
    return "".join(o.outputs[0].delta_text for o in outputs)


def test_stop_string_split_over_byte_tokens() -> None:
    outputs = feed(text_tokens("abcSTOPdef"), stop="STOP")
    final = outputs[-1]
    assert final.finished and final.finish_reason == "stop" and final.outputs[0].stop_reason == "STOP"
    assert final.text == "abc" and streamed(outputs) == "abc"
    assert len(final.token_ids) == 7  # generation ended at the token completing the stop string
    assert all("S" not in o.outputs[0].delta_text for o in outputs)  # a possible start was held back


def test_stop_string_kept_with_include_stop_str_in_output() -> None:
    outputs = feed(text_tokens("abcSTOPdef"), stop="STOP", include_stop_str_in_output=True)
    assert outputs[-1].text == "abcSTOP" and streamed(outputs) == "abcSTOP"


def test_stop_string_inside_multi_character_tokens() -> None:
    # "ST" + "OPx": the stop string ends in the middle of the second token; "x" is cut.
    outputs = feed([ord("a"), ST, OPX, YZ], stop=["TOP"])
    assert outputs[-1].text == "aS" and outputs[-1].outputs[0].stop_reason == "TOP"
    assert streamed(outputs) == "aS"
    assert len(outputs) == 3


def test_false_start_is_held_back_then_released() -> None:
    outputs = feed(text_tokens("abSTx") + [EOS], stop="STOP")
    deltas = [o.outputs[0].delta_text for o in outputs]
    assert deltas[:5] == ["a", "b", "", "", "STx"]
    assert outputs[-1].text == "abSTx" and outputs[-1].finish_reason == "stop"
    assert outputs[-1].outputs[0].stop_reason is None  # EOS, not a stop string


def test_earliest_stop_string_wins_and_multibyte_text_is_whole() -> None:
    outputs = feed(text_tokens("xé!yz"), stop=["yz", "é!"])
    assert outputs[-1].text == "x" and outputs[-1].outputs[0].stop_reason == "é!"
    assert all("\ufffd" not in o.text for o in outputs)


def test_held_back_text_is_flushed_when_length_ends_the_request() -> None:
    outputs = feed(text_tokens("abS"), stop="STOP", max_tokens=3)
    assert outputs[-1].finish_reason == "length" and streamed(outputs) == "abS"


def test_stop_token_ids_end_without_their_text() -> None:
    outputs = feed(text_tokens("abc!def"), stop_token_ids=[ord("!")])
    final = outputs[-1]
    assert final.text == "abc" and final.outputs[0].stop_reason == ord("!")
    assert final.token_ids[-1] == ord("!")


def test_eos_stops_unless_ignored() -> None:
    assert feed(text_tokens("ab") + [EOS, ord("c")])[-1].token_ids == [97, 98, EOS]
    ignored = feed(text_tokens("ab") + [EOS, ord("c")], ignore_eos=True, max_tokens=4)
    assert ignored[-1].token_ids == [97, 98, EOS, 99] and ignored[-1].text == "abc"
    assert ignored[-1].finish_reason == "length"


def test_min_tokens_defers_every_stop_but_length() -> None:
    outputs = feed([EOS, ord("S"), ord("T"), ord("O"), ord("P"), EOS], min_tokens=5, stop="STOP")
    # The EOS at token 1 is ignored; "STOP", completed by token 5, counts (5 >= min_tokens).
    assert len(outputs[-1].token_ids) == 5 and outputs[-1].outputs[0].stop_reason == "STOP"
    early = feed([EOS, ord("a"), EOS], min_tokens=2)
    assert early[-1].token_ids == [EOS, ord("a"), EOS]


def test_max_tokens_and_max_model_len() -> None:
    assert len(feed(text_tokens("abcdefgh"), max_tokens=5)[-1].token_ids) == 5
    # 1 prompt token + 3 generated = max_model_len 4.
    capped = feed(text_tokens("abcdefgh"), max_model_len=4)
    assert len(capped[-1].token_ids) == 3 and capped[-1].finish_reason == "length"


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
    assert "".join(u.outputs[0].delta_text for u in updates) == final.text == updates[-1].text
    assert sum(len(u.outputs[0].delta_token_ids) for u in updates) == 12
    assert updates[-1].token_ids == final.token_ids
