"""Writes tiny random-init Hugging Face folders (model + tokenizer) of six families; run by
tests/test_optimum_exports.py with the Optimum environment's python (its transformers 4.x), so the folders are
what that transformers writes. Also writes ``reference.json``: greedy token ids from transformers' ``generate``
for decoders. Usage: python _optimum_tiny_models.py OUT_ROOT PROMPT FAMILY [FAMILY ...] writes ``OUT_ROOT/FAMILY/hf``
and ``OUT_ROOT/FAMILY/hf.reference.json`` for each family, in one process (one torch + transformers import for the
whole matrix instead of one per family).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers as t
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

WORDS = ("good bad great awful movie film plot acting boring fun love hate the a was is and it not very "
         "story music scenes actors long short").split()
H, L = 256, 3  # classifier width/depth: the smallest the layer analysis early exit needs finds layers in


def classifier_tokenizer(family: str):
    cls, sep, pad, unk = ("<s>", "</s>", "<pad>", "<unk>") if family == "roberta" else ("[CLS]", "[SEP]", "[PAD]",
                                                                                          "[UNK]")
    vocab = {w: i for i, w in enumerate([pad, unk, cls, sep, *WORDS])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single=f"{cls} $A {sep}", special_tokens=[(cls, 2), (sep, 3)])
    names = ["input_ids", "token_type_ids", "attention_mask"] if family == "bert" else ["input_ids", "attention_mask"]
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=32, pad_token=pad, unk_token=unk,
                                   cls_token=cls, sep_token=sep, model_input_names=names), len(vocab)


def decoder_tokenizer():
    vocab = {w: i for i, w in enumerate(["<|endoftext|>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=64, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>"), len(vocab)


def config(family: str, n: int):
    labels = {"id2label": {0: "NEGATIVE", 1: "POSITIVE"}, "label2id": {"NEGATIVE": 0, "POSITIVE": 1}}
    if family == "bert":
        return t.BertForSequenceClassification, t.BertConfig(
            hidden_size=H, num_hidden_layers=L, num_attention_heads=4, intermediate_size=H, vocab_size=n,
            max_position_embeddings=64, initializer_range=0.1, **labels)
    if family == "roberta":
        return t.RobertaForSequenceClassification, t.RobertaConfig(
            hidden_size=H, num_hidden_layers=L, num_attention_heads=4, intermediate_size=H, vocab_size=n,
            max_position_embeddings=66, initializer_range=0.1, pad_token_id=0, bos_token_id=2, eos_token_id=3,
            type_vocab_size=1, **labels)
    if family == "distilbert":
        return t.DistilBertForSequenceClassification, t.DistilBertConfig(
            dim=H, n_layers=L, n_heads=4, hidden_dim=H, vocab_size=n, max_position_embeddings=64, pad_token_id=0,
            initializer_range=0.1, **labels)
    common = {"vocab_size": n, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    if family == "gpt2":
        return t.GPT2LMHeadModel, t.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, **common)
    cls, cfg_cls = (t.LlamaForCausalLM, t.LlamaConfig) if family == "llama" else (t.Qwen2ForCausalLM, t.Qwen2Config)
    return cls, cfg_cls(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=False, **common)


DECODERS = ("gpt2", "llama", "qwen2")


def write_model(family: str, out: Path):
    """Save a seeded random-init model of ``family`` and its tokenizer to ``out``; returns (model, tokenizer)."""
    tok, n = decoder_tokenizer() if family in DECODERS else classifier_tokenizer(family)
    cls, cfg = config(family, n)
    cfg.architectures = [cls.__name__]
    torch.manual_seed(0)
    model = cls(cfg).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return model, tok


def main(family: str, out: Path, prompt: str) -> None:
    decoder = family in DECODERS
    model, tok = write_model(family, out)
    ref = {}
    if decoder:
        ids = tok(prompt)["input_ids"]
        got = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=16, do_sample=False, pad_token_id=0)
        ref = {"prompt_ids": ids, "greedy_ids": got[0, len(ids):].tolist()}
    (out.parent / f"{out.name}.reference.json").write_text(json.dumps(ref))


if __name__ == "__main__":
    root, text = Path(sys.argv[1]), sys.argv[2]
    for fam in sys.argv[3:]:
        main(fam, root / fam / "hf", text)
