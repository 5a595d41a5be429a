"""A checkpoint's multi-token-prediction (MTP) head, the draft of `{"method": "mtp"}` speculation.

Qwen3.5, Qwen3-Next, DeepSeek-V3 and GLM-4.5 checkpoints ship, beside the language model, a head
trained to guess the token after next: for position i, from the target's final-norm hidden state
h_i and the token t_{i+1} after it,

    x_i = fc([norm_embedding(embed(t_{i+1})), norm_hidden(h_i)])
    y_i = the head's decoder layer(s)(x_i)    (attention causal over the head's own cache)
    logits_i = lm_head(final_norm(y_i))       -> a guess for t_{i+2}

with the target's embedding and (unless the checkpoint gives the head its own) LM head. A
further guess runs the head at position i + 1 on its own guess and its own state in place of
the target's. The two forms (ArchSpec.mtp_form) differ as vLLM runs them: Qwen's head
(`mtp.*`) continues from final_norm(y_i); DeepSeek-V3's and GLM-4.5's (the layer after the main
ones: eh_proj, enorm, hnorm, shared_head) continue from y_i and zero the embedding at position
0. transformers drops these heads at load, so the fixtures' goldens are composed from
transformers' modules (tools/make_mtp_fixture.py).

The head is a model of the target's family whose layers are the head's, each configured as the
target's attention layers, with its own KV cache.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from vkrt import ops
from vkrt.core.tensor import Tensor
from vkrt.errors import ModelFormatError, UnsupportedModelError
from vkrt.loader.arch import arch_named
from vkrt.loader.config import LoadedModel, WeightData
from vkrt.models.base import KVCache, StepTensors
from vkrt.models.decoder import DecoderModel, linear
from vkrt.models.weights import build_mtp_weights


def mtp_head_model(loaded: LoadedModel) -> LoadedModel:
    """The MTP head of `loaded` (which must have one) as a model of the same family whose layers
    are its decoder layers, each configured as the target's full-attention layers."""
    c = loaded.config
    attending = [i for i in range(c.num_layers) if c.layer(i).attends]
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


def _same_weight(a: WeightData | None, b: WeightData | None) -> bool:
    return (a is not None and b is not None and a.fmt == b.fmt and a.shape == b.shape
            and bool(np.array_equal(a.data, b.data)))


class MTPHead(DecoderModel):
    """The head on the target's device, sharing its embedding and LM head (the head's own
    shared_head.head only where it differs from the target's: released checkpoints copy it)."""

    def __init__(self, target: DecoderModel, head: LoadedModel) -> None:
        own_head = head.weights.get("mtp.lm_head")
        if own_head is not None and target.mtp_source is not None:
            source = target.mtp_source.weights
            if _same_weight(own_head, source.get("embed_tokens" if target.config.tie_word_embeddings else "lm_head")):
                own_head = None
        weights, self.input = build_mtp_weights(head, target.backend, target.weights, own_head is not None)
        super().__init__(head, target.backend, weights=weights)
        self.file_type = target.file_type
        self.form = arch_named(head.config.architecture).mtp_form  # how vLLM runs this family's head

    def forward(self, step: StepTensors, kv: KVCache) -> Tensor:
        raise UnsupportedModelError("an MTP head reads the target's hidden states: call forward_mtp")

    def forward_mtp(self, step: StepTensors, kv: KVCache, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """The logits of the rows in `step.logits_index` and every row's state [T, hidden] a
        further guess continues from (the final-norm output; in DeepSeek's form the layers' output
        before it), for the step's tokens (t_{i+1} at position i) beside `hidden` [T, hidden] (h_i)."""
        c, w = self.config, self.weights
        assert w.embed_tokens is not None and w.final_norm is not None
        e = ops.embedding(w.embed_tokens, step.token_ids)
        if c.embedding_scale != 1.0:
            e = ops.scale(e, c.embedding_scale)
        positions = None if step.batch is None else step.batch.positions
        if self.form == "deepseek_v3" and positions is not None and bool(np.any(positions == 0)):
            e = self.zero_first_positions(e, positions)
        both = ops.concat_columns(ops.rms_norm(e, self.input.norm_embedding, c.rms_norm_eps),
                                  ops.rms_norm(hidden, self.input.norm_hidden, c.rms_norm_eps))
        h = self.hidden_states(step, kv, linear(both, self.input.fc))
        out = h if self.form == "deepseek_v3" else ops.rms_norm(h, w.final_norm, c.rms_norm_eps)
        return self.head(h, step.logits_index), out

    def zero_first_positions(self, e: Tensor, positions: np.ndarray) -> Tensor:
        """The embeddings with the rows at position 0 zeroed (vLLM's DeepSeek MTP masks them):
        each row beside a zero row, then every row's own or its zero one gathered."""
        t, width = e.shape
        zero_or_own = np.arange(t, dtype=np.int32) * 2 + (positions == 0)
        both = ops.reshape(ops.concat_columns(e, ops.scale(e, 0.0)), (2 * t, width))
        return ops.gather_rows(both, self.backend.upload(zero_or_own.astype(np.int32), "i32", purpose="inputs"))
