"""A tiny random Gemma 4 checkpoint that an engine serves as it serves a real one: configs, safetensors
weights, a tokenizer holding Gemma 4's image, video and audio tokens, and a ``Gemma4Processor`` with a small
chat template. Built offline and deterministically (the same bytes for a seed).

    python tests/integrations/tiny_checkpoint.py DIRECTORY      # then: vllm's LLM(model=DIRECTORY, ...)

The language model is 2 layers of hidden 64 with heads of 32 (vLLM's CPU attention takes no smaller); the
vision tower the 26B/31B checkpoints' cut to 2 layers of 2 heads of 72, Gemma 4's patch size 16 and pooling
kernel 3, 70 soft tokens per image and per video frame. Recipe: docs/vllm.md.
"""

import sys

import torch

from fused_vision.bench.tower import LOW_MEMORY_TOWER, VISION_TOWERS

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>"]
# Gemma 4's multimodal tokens: the image placeholder and its brackets, the video and audio ones.
MEDIA = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "video_token": "<|video|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
}
WORDS = "user model describe the image video what is in this a and of to : 0 1 2 3 4 5 6 7 8 9 00 01 02 03".split()
SOFT_TOKENS = 70  # per image and per video frame: the smallest size Gemma 4's processors take

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|turn> {{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %} <|image|> {% elif item['type'] == 'video' %} <|video|> "
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %} <turn|> "
    "{% endfor %}{% if add_generation_prompt %}<|turn> model {% endif %}"
)


def vocabulary() -> dict[str, int]:
    return {token: index for index, token in enumerate([*SPECIAL, *MEDIA.values(), *WORDS])}


def config():
    from transformers.models.gemma4 import configuration_gemma4 as configuration

    vocab = vocabulary()
    # Heads of 32, the smallest vLLM's CPU attention takes; a sliding layer and a full one, as Gemma 4 mixes them.
    heads = dict(num_attention_heads=2, head_dim=32, global_head_dim=32)
    heads |= dict(num_key_value_heads=1, num_global_key_value_heads=1)
    layers = dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    text = configuration.Gemma4TextConfig(
        **heads,
        **layers,
        vocab_size=len(vocab),
        vocab_size_per_layer_input=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        hidden_size_per_layer_input=0,
        max_position_embeddings=4096,
    )
    # The 26B/31B checkpoints' tower (heads of 72, standardized, no clipped linears), 2 layers of 2 heads.
    tower = dict(VISION_TOWERS[LOW_MEMORY_TOWER], hidden_size=144, intermediate_size=288, num_hidden_layers=2)
    tower |= dict(num_attention_heads=2, num_key_value_heads=2, position_embedding_size=1024)
    vision = configuration.Gemma4VisionConfig(**tower, default_output_length=SOFT_TOKENS)
    tokens = {f"{kind}_id": vocab[MEDIA[kind]] for kind in ("boi_token", "eoi_token", "image_token", "video_token")}
    tokens |= dict(boa_token_id=vocab["<|audio>"], eoa_token_index=vocab["<audio|>"], audio_token_id=vocab["<|audio|>"])
    result = configuration.Gemma4Config(text_config=text, vision_config=vision, audio_config=None, **tokens)
    result.architectures = ["Gemma4ForConditionalGeneration"]
    return result


def tokenizer():
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocabulary(), unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(token, special=True) for token in [*SPECIAL, *MEDIA.values()]])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={kind: MEDIA[kind] for kind in MEDIA if kind != "video_token"},
        chat_template=CHAT_TEMPLATE,
    )


def processor(tokens):
    from transformers.models.gemma4 import (
        feature_extraction_gemma4,
        image_processing_gemma4,
        processing_gemma4,
        video_processing_gemma4,
    )

    return processing_gemma4.Gemma4Processor(
        feature_extractor=feature_extraction_gemma4.Gemma4AudioFeatureExtractor(),
        image_processor=image_processing_gemma4.Gemma4ImageProcessor(max_soft_tokens=SOFT_TOKENS),
        tokenizer=tokens,
        video_processor=video_processing_gemma4.Gemma4VideoProcessor(max_soft_tokens=SOFT_TOKENS, num_frames=4),
        chat_template=CHAT_TEMPLATE,
        image_seq_length=SOFT_TOKENS,
    )


def build(directory, seed: int = 0) -> str:
    """Save the checkpoint into ``directory``; the weights are drawn from ``seed``. Returns the directory."""
    from transformers import Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config()).eval()
    with torch.no_grad():  # a tower whose soft tokens differ enough between images to change the logits
        for name, parameter in model.named_parameters():
            if "vision" in name and parameter.dim() > 1:
                parameter.normal_(0, 0.1)
    model.save_pretrained(directory)
    tokens = tokenizer()
    tokens.save_pretrained(directory)
    processor(tokens).save_pretrained(directory)
    return str(directory)


if __name__ == "__main__":
    print(build(sys.argv[1]))
