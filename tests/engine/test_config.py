"""SamplingParams and EngineConfig validation: the offending field is named."""

from __future__ import annotations

import pytest

from vkrt.engine.config import EngineConfig, SamplingParams
from vkrt.errors import RequestError, VkrtError


@pytest.mark.parametrize("params, param", [
    (SamplingParams(max_tokens=0), "max_tokens"),
    (SamplingParams(max_tokens=-3), "max_tokens"),
    (SamplingParams(temperature=-0.1), "temperature"),
    (SamplingParams(top_k=-2), "top_k"),
    (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(top_p=1.5), "top_p"),
    (SamplingParams(min_p=1.1), "min_p"),
    (SamplingParams(presence_penalty=3.0), "presence_penalty"),
    (SamplingParams(frequency_penalty=-2.5), "frequency_penalty"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    (SamplingParams(logit_bias={256: 1.0}), "logit_bias"),
    (SamplingParams(logit_bias={-1: 1.0}), "logit_bias"),
    (SamplingParams(logit_bias={3: 101.0}), "logit_bias"),
    (SamplingParams(stop_token_ids=[300]), "stop_token_ids"),
    (SamplingParams(allowed_token_ids=[]), "allowed_token_ids"),
    (SamplingParams(allowed_token_ids=[1, 256]), "allowed_token_ids"),
    (SamplingParams(stop=["ok", ""]), "stop"),
    (SamplingParams(min_tokens=20, max_tokens=10), "min_tokens"),
    (SamplingParams(logprobs=21), "logprobs"),
    (SamplingParams(prompt_logprobs=-2), "prompt_logprobs"),
    (SamplingParams(prompt_logprobs=21), "prompt_logprobs"),
    (SamplingParams(logprob_token_ids=[0, 999]), "logprob_token_ids"),
    (SamplingParams(n=2), "n"),
    (SamplingParams(seed=-1), "seed"),
])
def test_bad_sampling_params_name_the_field(params: SamplingParams, param: str) -> None:
    with pytest.raises(RequestError) as info:
        params.validate(vocab_size=256)
    assert info.value.param == param and info.value.status == 400
    assert param in str(info.value)


def test_good_sampling_params_pass() -> None:
    SamplingParams(max_tokens=None, temperature=0.0, top_k=-1, top_p=0.5, min_p=0.1, logit_bias={255: -100},
                   stop="x", stop_token_ids=[1], min_tokens=3, logprobs=20, prompt_logprobs=-1,
                   logprob_token_ids=[0, 255], seed=2**62).validate(256)
    assert SamplingParams(stop="a").stop_strings == ["a"] and SamplingParams().stop_strings == []


def test_kv_pool_sizing() -> None:
    config = EngineConfig(max_num_seqs=4, block_size=16)
    assert config.resolve_num_blocks(bytes_per_block=1000, max_model_len=256) == 4 * 16
    assert EngineConfig(kv_cache_memory=50_000).resolve_num_blocks(1000, 256) == 50
    assert EngineConfig(num_kv_blocks=20).resolve_num_blocks(1000, 256) == 20
    with pytest.raises(VkrtError, match="max_model_len"):
        EngineConfig(kv_cache_memory=5_000).resolve_num_blocks(1000, 256)


def test_engine_config_validation() -> None:
    with pytest.raises(VkrtError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0).validate()
    with pytest.raises(VkrtError, match="kv_dtype"):
        EngineConfig(kv_dtype="q8").validate()
