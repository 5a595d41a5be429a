"""A checkpoint's multi-token-prediction (MTP) head, the draft of `{"method": "mtp"}` speculation.

Qwen3.5 and Qwen3-Next checkpoints ship, beside the language model, a head trained to guess the
token after next (`mtp.*`): for position i, from the target's final-norm hidden state h_i and
the token t_{i+1} after it,

    x_i = fc([norm_embedding(embed(t_{i+1})), norm_hidden(h_i)])
    y_i = the head's decoder layers(x_i)      (full attention, causal over the head's own cache)
    logits_i = lm_head(final_norm(y_i))       -> a guess for t_{i+2}

with the target's embedding and LM head. A further guess runs the head at position i + 1 on its
own guess and final_norm(y_i) in place of the target's hidden state. This is the form vLLM
serves these heads in; transformers drops them at load, so the fixture's golden is composed from
transformers' modules (tools/make_mtp_fixture.py).

The head is a one-layer (or N-layer) model of the target's family: its layers are built by the
decoder as the target's full-attention layers are, with their own KV cache.
"""

from __future__ import annotations

from dataclasses import replace

from vkrt import ops
from vkrt.core.tensor import Tensor
from vkrt.errors import ModelFormatError, UnsupportedModelError
from vkrt.loader.config import LoadedModel
from vkrt.models.base import KVCache, StepTensors
from vkrt.models.decoder import DecoderModel, linear
from vkrt.models.weights import build_mtp_weights


def mtp_head_model(loaded: LoadedModel) -> LoadedModel:
    """The MTP head of `loaded` (which must have one) as a model of the same family whose layers
    are its decoder layers, each configured as the target's full-attention layers."""
    c = loaded.config
    attending = [i for i in range(c.num_layers) if c.layer(i).mixer == "attention"]
    if not attending:
        raise UnsupportedModelError(f"{loaded.path}: the MTP head's layers are attention layers, and this model "
                                    "has none to take their shape from")
    count = len({name.split(".")[1] for name in loaded.mtp_weights if name.startswith("layers.")})
    missing = [n for n in ("mtp.fc", "mtp.norm_embedding", "mtp.norm_hidden", "final_norm")
               if n not in loaded.mtp_weights]
    if not count or missing:
        raise ModelFormatError(f"{loaded.path}: the multi-token-prediction head is incomplete "
                               f"(missing {', '.join(missing) or 'its decoder layers'}); re-download the model")
    fc = loaded.mtp_weights["mtp.fc"]
    if fc.shape != (c.hidden_size, 2 * c.hidden_size):
        raise ModelFormatError(f"{loaded.path}: the MTP head's fc is {list(fc.shape)}, expected "
                               f"[{c.hidden_size}, {2 * c.hidden_size}]")
    config = replace(c, num_layers=count, layers=(c.layer(attending[-1]),) * count)
    return LoadedModel(path=f"{loaded.path} (MTP head)", config=config, weights=loaded.mtp_weights,
                       file_type=loaded.file_type)


class MTPHead(DecoderModel):
    """The head on the target's device, sharing its embedding and LM head."""

    def __init__(self, target: DecoderModel, head: LoadedModel) -> None:
        weights, self.input = build_mtp_weights(head, target.backend, target.weights)
        super().__init__(head, target.backend, weights=weights)
        self.file_type = target.file_type

    def forward(self, step: StepTensors, kv: KVCache) -> Tensor:
        raise UnsupportedModelError("an MTP head reads the target's hidden states: call forward_mtp")

    def forward_mtp(self, step: StepTensors, kv: KVCache, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """The logits of the rows in `step.logits_index` and every row's final-norm output
        [T, hidden] (the hidden state a further guess continues from), for the step's tokens
        (t_{i+1} at position i) beside `hidden` [T, hidden] (h_i)."""
        c, w = self.config, self.weights
        assert w.embed_tokens is not None and w.final_norm is not None
        e = ops.embedding(w.embed_tokens, step.token_ids)
        if c.embedding_scale != 1.0:
            e = ops.scale(e, c.embedding_scale)
        both = ops.concat_columns(ops.rms_norm(e, self.input.norm_embedding, c.rms_norm_eps),
                                  ops.rms_norm(hidden, self.input.norm_hidden, c.rms_norm_eps))
        h = self.hidden_states(step, kv, linear(both, self.input.fc))
        return self.head(h, step.logits_index), ops.rms_norm(h, w.final_norm, c.rms_norm_eps)
