"""Model folders the project builds for itself, deterministically.

`tiny`: a tiny random-weight Qwen3-Omni checkpoint with every component of the real one and a byte-level
tokenizer with its special tokens; tests and the CPU mesh run on it. `full`: the real config, tokenizer ids and
processor settings, no weights, for `load_format: random`.

    python -m services.model.build {tiny,full} OUT_DIR [--seed 0]
"""

import argparse
import copy
import json
from pathlib import Path

import torch

from services.model.load import init_weights_
from services.model.spec import FULL_CONFIG_PATH

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
    "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
    "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
]
ROLE_WORDS = ["system", "user", "assistant"]
THINKER_VOCAB = 320
CODEBOOK = 64
CODE_GROUPS = 4

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'audio' -%}{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


# Ids of the released tokenizer: the full-size skeleton keeps them, the tiny one numbers its own.
REAL_IDS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
    "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|image_pad|>": 151655, "<|video_pad|>": 151656,
    "<|audio_start|>": 151669, "<|audio_end|>": 151670, "<|audio_pad|>": 151675,
    "<tts_pad>": 151671, "<tts_text_bos>": 151672, "<tts_text_eod>": 151673,
    "system": 8948, "user": 872, "assistant": 77091,
}


def build_tokenizer(real_ids: bool = False, vocab_size: int = 0):
    """Byte-level BPE with merges only for the role words, and the special tokens; `real_ids`: the released ids,
    the vocabulary filled to `vocab_size` with tokens no text produces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2Tokenizer

    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    vocab = {s: i for i, s in enumerate(byte_symbols)}
    fixed = REAL_IDS if real_ids else {}
    taken = set(fixed.values())
    next_id = iter(i for i in range(len(vocab), 1 << 30) if i not in taken)
    merges = []
    for word in ROLE_WORDS:
        for end in range(2, len(word) + 1):
            left, piece = word[: end - 1], word[:end]
            if piece not in vocab:
                merges.append((left, word[end - 1]))
                vocab[piece] = fixed.get(piece) if piece in fixed else next(next_id)
    for token in SPECIAL_TOKENS:
        vocab[token] = fixed.get(token) if token in fixed else next(next_id)
    if real_ids:
        used = set(vocab.values())
        vocab.update({f"<|unused_{i}|>": i for i in range(vocab_size) if i not in used})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return Qwen2Tokenizer(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        image_token="<|image_pad|>",
        audio_token="<|audio_pad|>",
        video_token="<|video_pad|>",
        vision_bos_token="<|vision_start|>",
        vision_eos_token="<|vision_end|>",
        audio_bos_token="<|audio_start|>",
        audio_eos_token="<|audio_end|>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_config_dict(tokenizer) -> dict:
    """The real config with every size shrunk and every token id taken from the tiny tokenizer."""
    ids = tokenizer.convert_tokens_to_ids
    cfg = copy.deepcopy(json.loads(Path(FULL_CONFIG_PATH).read_text()))
    mm_ids = dict(
        audio_start_token_id=ids("<|audio_start|>"), audio_end_token_id=ids("<|audio_end|>"),
        audio_token_id=ids("<|audio_pad|>"), image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
    )
    cfg.update(
        im_start_token_id=ids("<|im_start|>"), im_end_token_id=ids("<|im_end|>"),
        tts_pad_token_id=ids("<tts_pad>"), tts_bos_token_id=ids("<tts_text_bos>"),
        tts_eos_token_id=ids("<tts_text_eod>"),
        system_token_id=ids("system"), user_token_id=ids("user"), assistant_token_id=ids("assistant"),
    )
    th = cfg["thinker_config"]
    th.update(mm_ids, vision_end_token_id=ids("<|vision_end|>"), user_token_id=ids("user"))
    th["text_config"].update(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=16,
        vocab_size=THINKER_VOCAB, max_position_embeddings=4096,
    )
    th["text_config"]["rope_parameters"]["mrope_section"] = [2, 1, 1]
    th["audio_config"].update(
        d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
        downsample_hidden_size=8, output_dim=32,
    )
    th["vision_config"].update(
        depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
        deepstack_visual_indexes=[0, 1],
    )
    tk = cfg["talker_config"]
    # Codec ids keep the real offsets from the codebook (pad = codebook + 100, speakers at +253..255).
    off = CODEBOOK - 2048
    for key in ("codec_bos_id", "codec_eos_token_id", "codec_nothink_id", "codec_pad_id",
                "codec_think_bos_id", "codec_think_eos_id"):
        tk[key] += off
    tk["speaker_id"] = {name: v + off for name, v in tk["speaker_id"].items()}
    tk.update(mm_ids, accept_hidden_layer=1, num_code_groups=CODE_GROUPS, thinker_hidden_size=32)
    tk["text_config"].update(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=16,
        shared_expert_intermediate_size=16, vocab_size=CODEBOOK + 1024, max_position_embeddings=4096,
    )
    tk["text_config"]["rope_parameters"]["mrope_section"] = [2, 1, 1]
    tk["code_predictor_config"].update(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=32, vocab_size=CODEBOOK, num_code_groups=CODE_GROUPS, max_position_embeddings=64,
    )
    cfg["code2wav_config"].update(
        codebook_size=CODEBOOK, num_quantizers=CODE_GROUPS, hidden_size=16, intermediate_size=32,
        num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1, decoder_dim=16,
    )
    return cfg


@torch.no_grad()
def _set_waveform_level_(code2wav, seed: int, level: float = 0.15) -> None:
    """Scales code2wav's last convolution so random codes give speech-like levels, not silence or clipping."""
    cfg = code2wav.config
    codes = torch.randint(0, cfg.codebook_size, (2, cfg.num_quantizers, 40), generator=torch.Generator().manual_seed(seed))
    last = code2wav.decoder[-1].conv
    seen = []
    handle = last.register_forward_hook(lambda mod, args, out: seen.append(out))
    code2wav(codes)
    handle.remove()
    raw = seen[0]
    scale = level / raw.std().item()
    last.bias.sub_(raw.mean()).mul_(scale)
    last.weight.mul_(scale)


def _save_processors(out: Path) -> None:
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": 3136, "longest_edge": 12845056},
    )
    feature_extractor = WhisperFeatureExtractor(
        feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400, chunk_length=30,
        padding_value=0.0, return_attention_mask=True,
    )
    # The released checkpoint keeps both processors' settings in one file
    merged = {**json.loads(feature_extractor.to_json_string()), **json.loads(image_processor.to_json_string())}
    merged.pop("mel_filters", None)
    merged["image_processor_type"] = "Qwen2VLImageProcessor"
    (out / "preprocessor_config.json").write_text(json.dumps(merged, indent=2))


def build_tiny(out_dir: str | Path, seed: int = 0) -> Path:
    from transformers.models.qwen3_omni_moe import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = Qwen3OmniMoeConfig(**tiny_config_dict(tokenizer))
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config).float().eval()
    init_weights_(model.thinker, seed, lm=True)
    init_weights_(model.talker, seed + 1, lm=True)
    init_weights_(model.code2wav, seed + 2, conv_gain=0.6)
    _set_waveform_level_(model.code2wav, seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _save_processors(out)
    return out


def build_full_skeleton(out_dir: str | Path) -> Path:
    """The full-size model's folder without weights, for `load_format: random`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads(Path(FULL_CONFIG_PATH).read_text())
    build_tokenizer(real_ids=True, vocab_size=config["thinker_config"]["text_config"]["vocab_size"]).save_pretrained(out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _save_processors(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["tiny", "full"])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_tiny(args.out_dir, args.seed) if args.kind == "tiny" else build_full_skeleton(args.out_dir))


if __name__ == "__main__":
    main()
