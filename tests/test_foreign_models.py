"""Foreign-model matrix: tiny random-init transformers models of six families, exported in the test with
``dyncompile export`` into the Optimum folder layout, then through each technique.

Families: BERT, RoBERTa, DistilBERT (``*ForSequenceClassification``, 2 layers, hidden 32) and GPT-2, Llama, Qwen2
(``*ForCausalLM``, 2 layers, KV cache). For each: ``inspect`` (family and task), ``verify,cleanup`` exact against
the exported ONNX in ONNX Runtime (<= 1e-5), then early exit on classifiers (compile with a small calibration file
and run, or a refusal that names its reason) and speculative prompt lookup at the default ``-O`` level on decoders
(greedy output token-identical to the target alone and to transformers' greedy ``generate``). The table of
results is in docs/your-own-model.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import assert_clean_error, run_cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dyncompile  # noqa: E402
from dyncompile.errors import DyncompileError  # noqa: E402
from dyncompile.passes.compiler import compile_model  # noqa: E402

WORDS = ("good bad great awful movie film plot acting boring fun love hate the a was is and it not very "
         "story music scenes actors long short").split()
POSITIVE = ("good", "great", "fun", "love")
PROMPT = "the movie was good and the plot was"
CLASSIFIERS = ("bert", "roberta", "distilbert")
DECODERS = ("gpt2", "llama", "qwen2")


def _classifier_tokenizer(family: str):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    cls, sep, pad, unk = ("<s>", "</s>", "<pad>", "<unk>") if family == "roberta" else ("[CLS]", "[SEP]", "[PAD]",
                                                                                          "[UNK]")
    vocab = {t: i for i, t in enumerate([pad, unk, cls, sep, *WORDS])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single=f"{cls} $A {sep}", special_tokens=[(cls, 2), (sep, 3)])
    names = ["input_ids", "token_type_ids", "attention_mask"] if family == "bert" else ["input_ids", "attention_mask"]
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=32, pad_token=pad, unk_token=unk,
                                   cls_token=cls, sep_token=sep, model_input_names=names), len(vocab)


def _decoder_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<|endoftext|>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=64, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>"), len(vocab)


def _config(family: str, n: int):
    t = transformers
    labels = {"id2label": {0: "NEGATIVE", 1: "POSITIVE"}, "label2id": {"NEGATIVE": 0, "POSITIVE": 1}}
    if family == "bert":
        return t.BertForSequenceClassification, t.BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=n,
            max_position_embeddings=64, **labels)
    if family == "roberta":
        return t.RobertaForSequenceClassification, t.RobertaConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=n,
            max_position_embeddings=66, pad_token_id=0, bos_token_id=2, eos_token_id=3, type_vocab_size=1, **labels)
    if family == "distilbert":
        return t.DistilBertForSequenceClassification, t.DistilBertConfig(
            dim=32, n_layers=2, n_heads=2, hidden_dim=64, vocab_size=n, max_position_embeddings=64, pad_token_id=0,
            **labels)
    common = {"vocab_size": n, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    if family == "gpt2":
        return t.GPT2LMHeadModel, t.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, **common)
    cls, cfg_cls = (t.LlamaForCausalLM, t.LlamaConfig) if family == "llama" else (t.Qwen2ForCausalLM, t.Qwen2Config)
    return cls, cfg_cls(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=False, **common)


@pytest.fixture(scope="module", params=CLASSIFIERS + DECODERS)
def exported(request, module_tmp):
    """A tiny random-init HF folder (save_pretrained) of one family and its ``dyncompile export`` folder."""
    return _build(request.param, module_tmp(f"foreign-{request.param}"))


def _build(family: str, root: Path) -> SimpleNamespace:
    hf, out = root / "hf", root / "onnx"
    decoder = family in DECODERS
    tok, n = _decoder_tokenizer() if decoder else _classifier_tokenizer(family)
    cls, cfg = _config(family, n)
    cfg.architectures = [cls.__name__]
    torch.manual_seed(0)
    model = cls(cfg).eval()
    if not decoder:  # random-init classifier heads are near-uniform; larger weights give distinct exits
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(4.0)
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    rc, stdout, err = _cli("export", hf, "-o", out)
    assert rc == 0, err
    return SimpleNamespace(family=family, hf=hf, path=out, model=model, tokenizer=tok, decoder=decoder, root=root)


def _cli(*argv):
    from contextlib import redirect_stderr, redirect_stdout
    from io import StringIO

    from dyncompile.tools.cli import main

    o, e = StringIO(), StringIO()
    with redirect_stdout(o), redirect_stderr(e):
        rc = main([str(a) for a in argv])
    return rc, o.getvalue(), e.getvalue()
