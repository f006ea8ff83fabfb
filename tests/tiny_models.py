"""Tiny random models built at test time (no hub): a BPE tokenizer trained with
``tokenizers`` and a 2-layer Llama with random weights, saved as a normal
model folder that transformers and vLLM load."""

from __future__ import annotations

import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = (
    "the a tree draft token verify accept reject sample model fast slow cat dog run jump "
    "red blue green one two three four five six seven eight nine ten and or but if then"
).split()


def _corpus(seed: int, lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20))) for _ in range(lines)]


def build_tokenizer(path: Path, vocab_size: int, seed: int = 0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[: max(0, vocab_size - 64)],
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def build_tiny_llama(
    path: Path,
    vocab_size: int = 512,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 1,
    logit_scale: float = 1.0,
    weights_seed: int | None = None,
) -> Path:
    """A random Llama whose head size (hidden / heads = 32) the CPU attention supports.

    ``seed`` fixes the tokenizer (models built with the same seed share a vocabulary);
    ``weights_seed`` (default: ``seed``) fixes the weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    tok = build_tokenizer(path, vocab_size, seed)
    torch.manual_seed(seed if weights_seed is None else weights_seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper, more varied next-token laws than the default init
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(path)
    return path


def build_perturbed_draft(target: Path, path: Path, noise: float = 0.5, seed: int = 1) -> Path:
    """A draft for ``target``: the same tokenizer and architecture, every weight
    moved by ``noise`` times its tensor's standard deviation (random direction),
    so draft and target agree often but not always."""
    import shutil

    import torch
    from transformers import LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    shutil.copytree(target, path)
    model = LlamaForCausalLM.from_pretrained(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            scale = param.std() if param.numel() > 1 else param.abs()
            param.add_(noise * scale * torch.randn(param.shape, generator=gen))
    model.save_pretrained(path)
    return path


def build_confident_draft(draft: Path, path: Path, gain: float) -> Path:
    """``draft`` with its logits multiplied by ``gain`` (the final norm's weight scaled):
    the same top tokens, nearly sure of them (a gain of 10 puts the top token of most
    contexts above 1 - 1e-9), like a small draft at low temperature on code."""
    import shutil

    import torch
    from transformers import LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    shutil.copytree(draft, path)
    model = LlamaForCausalLM.from_pretrained(draft)
    with torch.no_grad():
        model.model.norm.weight.mul_(gain)
    model.save_pretrained(path)
    return path
