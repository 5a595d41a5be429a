"""render_chat's continue_final_message: the final assistant message is left open."""

from __future__ import annotations

from engine_fakes import byte_tokenizer

from vkrt.engine.prompts import render_chat


def test_continue_final_message_cuts_after_the_final_message_not_an_earlier_copy() -> None:
    """The partial reply also appears in the user's turn: the prompt must end with the reply
    (the template's end-of-turn after it cut), not be cut inside the user turn."""
    messages = [{"role": "user", "content": "Paris is nice. Say Paris"}, {"role": "assistant", "content": "Paris"}]
    text, ids = render_chat(byte_tokenizer(), messages, add_generation_prompt=False, continue_final_message=True)
    assert text == "user: Paris is nice. Say Paris\nassistant: Paris"
    assert bytes(ids).decode() == text
