"""Preprocessing done on a GPU (the encoder's half of preprocess.audio: pcm), against the CPU reference."""

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


def test_log_mel_on_the_gpu_equals_the_feature_extractor(tiny_model):
    """The encoder's LogMel on cuda:0 gives the Whisper extractor's features (the tiny model's processor
    config is the real one's) to float32 rounding of a GPU FFT, for clips of 1, 7 and 30 seconds."""
    from transformers import WhisperFeatureExtractor

    from services.preprocess.media import LogMel

    fe, mel = WhisperFeatureExtractor.from_pretrained(tiny_model), LogMel(tiny_model)
    rng = np.random.default_rng(1)
    for seconds in (1, 7, 30):
        pcm = (rng.standard_normal(16000 * seconds) * 0.1).astype(np.float32)
        pcm[: len(pcm) // 4] = 0
        out = fe([pcm], sampling_rate=16000, padding=True, truncation=False, return_attention_mask=True, return_tensors="np")
        expected = torch.from_numpy(out["input_features"][0][:, : int(out["attention_mask"][0].sum())])
        got = mel(torch.from_numpy(pcm).cuda())
        assert got.is_cuda and got.shape == expected.shape
        torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=1e-4)
