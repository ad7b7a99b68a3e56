"""Qwen3-ASR targets carry the audio-config fields vLLM's Qwen3-ASR reads beyond transformers' config
(`conv_chunksize`, `max_source_positions`): the tiny builder writes them, `dflash-train` warns where a target lacks
them, and where vLLM is importable its own config loader reads them. (vLLM's Qwen3-ASR module itself imports
transformers' Qwen2-VL image processor, which needs torchvision, absent over a CPU torch: its encoder's construction is
exercised by the GPU target-alone check of `benchmarks/vllm_parity.py`, not here.)"""

from __future__ import annotations

import json
import logging

import pytest
from transformers import Qwen3ASRConfig, Qwen3Config
from utils import require_vllm

from dflash_hf.targets.families import qwen3_asr
from dflash_hf.testing import tiny


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory):
    return tiny.save_tiny_target(tmp_path_factory.mktemp("asr") / "target", kind="qwen3_asr")


def test_a_saved_tiny_qwen3_asr_target_carries_the_vllm_serving_fields(saved_target):
    audio = json.loads((saved_target / "config.json").read_text())["audio_config"]
    assert audio["conv_chunksize"] == qwen3_asr.VLLM_CONV_CHUNKSIZE == 500
    assert audio["max_source_positions"] == audio["max_position_embeddings"]
    assert audio["n_window"] == 50  # vLLM's placeholder count assumes 100-frame chunks


def test_a_transformers_config_lacks_them_and_adding_keeps_what_is_set(caplog):
    config = Qwen3ASRConfig()
    assert qwen3_asr.missing_vllm_serving_fields(config) == ["conv_chunksize", "max_source_positions"]
    config.audio_config.conv_chunksize = 64
    with caplog.at_level(logging.WARNING, logger=qwen3_asr.__name__):
        qwen3_asr.warn_missing_vllm_serving_fields(config, "runs/target")
    (record,) = caplog.records
    assert "target runs/target: its audio_config lacks max_source_positions" in record.getMessage()
    assert '"max_source_positions": 13' in record.getMessage() and "add_vllm_serving_fields" in record.getMessage()
    assert qwen3_asr.add_vllm_serving_fields(config) == ["max_source_positions"]
    assert (config.audio_config.conv_chunksize, config.audio_config.max_source_positions) == (64, 13)
    assert qwen3_asr.missing_vllm_serving_fields(config) == []
    assert qwen3_asr.missing_vllm_serving_fields(Qwen3Config()) == []  # other targets: nothing to add
    assert qwen3_asr.add_vllm_serving_fields(Qwen3Config()) == []


def test_with_vllm_its_config_loader_reads_them(saved_target):
    require_vllm()
    from vllm.transformers_utils.config import get_config

    audio = get_config(str(saved_target), trust_remote_code=False).audio_config
    assert audio.conv_chunksize == 500 and audio.max_source_positions == audio.max_position_embeddings
