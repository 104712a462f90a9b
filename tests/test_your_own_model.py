"""Bring your own model: a folder laid out like an Optimum / Hugging Face export (``model.onnx`` beside
``config.json``, ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``) compiles and runs
without a hand-written ``dyncompile-model.json``, and behaves like transformers on the same weights.

The models are tiny random-init transformers models (a 3-layer BERT classifier whose weights are large enough for the layer analysis, a 2-layer GPT-2), exported in the
test with the recipes' exporter into the file layout ``optimum-cli export onnx`` writes (optimum-onnx itself pins
an older transformers, so it cannot be installed beside this one; the layout is emulated).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import assert_clean_error, run_cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dyncompile  # noqa: E402
from dyncompile.passes.compiler import compile_model  # noqa: E402

WORDS = ("good bad great awful movie film plot acting boring fun love hate the a was is and it not very "
         "story music scenes actors long short").split()
MAX_LEN = 16  # the classifier tokenizer's model_max_length (its position table has 128 rows)
N_POSITIONS = 24  # the decoder's position table


def _wordpiece():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return tok, len(vocab)


def _export(module, args, names, outputs, dyn, path: Path) -> None:
    from dyncompile.models._export import export_onnx

    export_onnx(module, args, input_names=names, output_names=outputs, dynamic_shapes=dyn, out_path=path)


@pytest.fixture(scope="module")
def bert_dir(module_tmp):
    """An Optimum-style text-classification folder: model.onnx, config.json (id2label), tokenizer files."""
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    d = module_tmp("bert") / "bert-sst2"
    d.mkdir()
    tok, n = _wordpiece()
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=256, num_hidden_layers=3, num_attention_heads=4, intermediate_size=256, vocab_size=n,
                     max_position_embeddings=128, initializer_range=0.1, id2label={0: "NEGATIVE", 1: "POSITIVE"},
                     label2id={"NEGATIVE": 0, "POSITIVE": 1}, architectures=["BertForSequenceClassification"])
    model = BertForSequenceClassification(cfg).eval()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=MAX_LEN, pad_token="[PAD]",
                                     unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                     model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    hf_tok.save_pretrained(d)
    cfg.save_pretrained(d)

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.model = m

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits

    names = ("input_ids", "attention_mask", "token_type_ids")
    ex = hf_tok(["good movie", "bad plot and acting"], padding=True, return_tensors="pt")
    b, s = torch.export.Dim("batch"), torch.export.Dim("seq")
    _export(Logits(model), tuple(ex[k] for k in names), names, ["logits"], {k: {0: b, 1: s} for k in names},
            d / "model.onnx")
    return SimpleNamespace(path=d, model=model, tokenizer=hf_tok)  # the folder + the transformers reference


def _greedy_ids(model, ids: list[int], n: int, **kw) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def gpt2_dir(module_tmp):
    """An Optimum-style text-generation folder (KV-cache decoder, Optimum's input/output names) whose
    generation_config.json names an end-of-text token that greedy decoding reaches after a few tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    from transformers.cache_utils import DynamicCache

    d = module_tmp("gpt2") / "tiny-gpt2"
    d.mkdir()
    vocab = {t: i for i, t in enumerate(["<|endoftext|>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=len(vocab), n_positions=N_POSITIONS, bos_token_id=0,
                     eos_token_id=0, architectures=["GPT2LMHeadModel"])
    model = GPT2LMHeadModel(cfg).eval()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=N_POSITIONS, eos_token="<|endoftext|>",
                                     bos_token="<|endoftext|>")
    hf_tok.save_pretrained(d)
    cfg.save_pretrained(d)

    class KV(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.model = m

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(2)])
            o = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           past_key_values=cache, use_cache=True)
            flat = []
            for layer in o.past_key_values.layers:
                flat += [layer.keys, layer.values]
            return (o.logits, *flat)

    b, s, p, t = (torch.export.Dim(x) for x in ("batch", "seq", "past", "total"))
    names = ["input_ids", "attention_mask", "position_ids",
             *(f"past_key_values.{i}.{k}" for i in range(2) for k in ("key", "value"))]
    outs = ["logits", *(f"present.{i}.{k}" for i in range(2) for k in ("key", "value"))]
    args = (torch.tensor([[3, 4, 5, 6]] * 2), torch.ones(2, 7, dtype=torch.long), torch.tensor([[3, 4, 5, 6]] * 2),
            *(torch.randn(2, 2, 3, 16) for _ in range(4)))
    dyn = {"input_ids": {0: b, 1: s}, "attention_mask": {0: b, 1: t}, "position_ids": {0: b, 1: s},
           "past": tuple({0: b, 2: p} for _ in range(4))}
    _export(KV(model), args, names, outs, dyn, d / "model.onnx")
    # the end-of-text token: a token greedy decoding of PROMPT first produces a few steps in (so that it stops there)
    prompt_ids = hf_tok(PROMPT)["input_ids"]
    free = _greedy_ids(model, prompt_ids, 12, eos_token_id=None, pad_token_id=0)
    k = next(i for i in range(2, len(free)) if free[i] not in free[:i] and free[i] not in prompt_ids)
    model.generation_config.eos_token_id = free[k]
    model.generation_config.pad_token_id = 0
    model.generation_config.save_pretrained(d)
    return SimpleNamespace(path=d, model=model, tokenizer=hf_tok, free=free, eos_at=k)


PROMPT = "the movie was"


@pytest.fixture(scope="module")
def bert_plan(bert_dir, module_tmp):
    # the ONNX file of the folder (the folder itself works too: see the tests below)
    return compile_model(bert_dir.path / "model.onnx", "verify,cleanup", module_tmp("bert_plan") / "plan",
                         progress=False).plan_dir


@pytest.fixture(scope="module")
def gpt2_plan(gpt2_dir, module_tmp):
    return compile_model(gpt2_dir.path / "model.onnx", "verify,cleanup", module_tmp("gpt2_plan") / "plan",
                         progress=False).plan_dir


def _reference_proba(bert_dir, text: str, **tok_kw) -> np.ndarray:
    enc = bert_dir.tokenizer(text, return_tensors="pt", **tok_kw)
    with torch.no_grad():
        logits = bert_dir.model(**enc).logits
    return torch.softmax(logits.double(), -1)[0].numpy()


# ------------------------------------------------------------------------------------------ classifier folder


def test_folder_task_and_labels_come_from_config_json(bert_plan):
    plan = json.loads((bert_plan / "plan.json").read_text())
    assert plan["task"] == "text-classification"
    assert plan["labels"] == ["NEGATIVE", "POSITIVE"]
    assert plan["tokenizer"]["max_length"] == MAX_LEN  # tokenizer_config.json's model_max_length


def test_run_text_on_a_plain_folder(capsys, bert_plan):
    rc, out, err = run_cli(capsys, "run", bert_plan, "--text", "a good movie")
    assert rc == 0, err
    assert "POSITIVE" in out or "NEGATIVE" in out


def test_truncates_at_model_max_length_like_transformers(bert_dir, bert_plan):
    text = " ".join(WORDS * 2)  # ~60 tokens: past model_max_length, inside the position table
    ref = _reference_proba(bert_dir, text, truncation=True, max_length=MAX_LEN)
    untruncated = _reference_proba(bert_dir, text)
    assert abs(ref[1] - untruncated[1]) > 1e-4  # the test can tell the two apart
    got = dyncompile.load(bert_plan).predict_proba([text])[0]
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_model_max_length_sentinel_falls_back_to_the_position_table(bert_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(bert_dir.path, d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["model_max_length"] = int(1e30)  # what transformers writes when the tokenizer sets no limit
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    plan = compile_model(d, "verify", tmp_path / "p", progress=False).plan
    assert plan.tokenizer["max_length"] == 128


def test_string_labels_in_calibration_data(bert_dir, tmp_path):
    # calibration rows labelled by name (as in the model's id2label) are understood by early exit
    rows = [{"text": f"{a} {b} {c}", "label": "POSITIVE" if a in ("good", "great", "fun", "love") else "NEGATIVE"}
            for a in ("good", "bad", "great", "awful", "fun", "boring", "love", "hate")
            for b in ("movie", "film", "plot", "acting") for c in ("very", "not", "and") for d in ("the", "a")]
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = compile_model(bert_dir.path / "model.onnx", "early-exit{budget=50}", tmp_path / "ee", calib=calib,
                        progress=False)
    assert res.plan.task == "text-classification" and res.plan.labels == ["NEGATIVE", "POSITIVE"]
    assert "early_exit" in res.plan.policy


def test_sidecar_overrides_the_hf_files(bert_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(bert_dir.path, d)
    (d / "dyncompile-model.json").write_text(json.dumps({"labels": ["neg", "pos"], "max_length": 8}))
    plan = compile_model(d, "verify", tmp_path / "p", progress=False).plan
    assert plan.labels == ["neg", "pos"] and plan.tokenizer["max_length"] == 8
    assert plan.task == "text-classification"  # what the sidecar leaves out still comes from config.json


@pytest.mark.parametrize(("key", "value"), [("id2label", "POSITIVE"), ("architectures", 7),
                                            ("max_position_embeddings", "many")])
def test_bad_config_json_is_one_error_line(capsys, bert_dir, tmp_path, key, value):
    d = tmp_path / "m"
    shutil.copytree(bert_dir.path, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run_cli(capsys, d, "-o", tmp_path / "p")
    assert_clean_error(rc, err, "config.json", key)


def test_architecture_table():
    from dyncompile.passes.analysis.hf_metadata import task_from_architectures

    assert task_from_architectures(["BertForSequenceClassification"]) == "text-classification"
    assert task_from_architectures(["GPT2LMHeadModel"]) == "text-generation"
    assert task_from_architectures(["LlamaForCausalLM"]) == "text-generation"
    assert task_from_architectures(["BertForTokenClassification"]) == "token-classification"
    assert task_from_architectures(["BertModel"]) == "feature-extraction"
    assert task_from_architectures(["Wav2Vec2ForCTC"]) is None
    assert task_from_architectures(None) is None


# ------------------------------------------------------------------------------------------ decoder folder


@pytest.mark.parametrize("task_sidecar", [False, True])
def test_decoder_stops_at_generation_config_eos_like_transformers(gpt2_dir, gpt2_plan, tmp_path, task_sidecar):
    ids = gpt2_dir.tokenizer(PROMPT)["input_ids"]
    ref = _greedy_ids(gpt2_dir.model, ids, 15)  # the folder's generation_config: stops at its eos token
    assert len(ref) == gpt2_dir.eos_at + 1 < 15
    plan = gpt2_plan
    if task_sidecar:  # a dyncompile-model.json that only names the task: the rest still comes from the HF files
        d = tmp_path / "m"
        shutil.copytree(gpt2_dir.path, d)
        (d / "dyncompile-model.json").write_text(json.dumps({"task": "text-generation"}))
        plan = compile_model(d / "model.onnx", "verify,cleanup", tmp_path / "p", progress=False).plan_dir
    res = dyncompile.load(plan).generate(PROMPT, max_new_tokens=15)
    assert res.token_ids == ref
    assert res.stats.stop_reason == "eos"


@pytest.mark.parametrize("task_sidecar", [False, True])
def test_decoder_stops_at_the_position_limit(gpt2_dir, tmp_path, caplog, task_sidecar):
    d = tmp_path / "noeos"
    shutil.copytree(gpt2_dir.path, d)
    if task_sidecar:
        (d / "dyncompile-model.json").write_text(json.dumps({"task": "text-generation"}))
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((d / name).read_text())
        cfg["eos_token_id"] = None
        (d / name).write_text(json.dumps(cfg))
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.pop("eos_token", None)
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    plan = compile_model(d / "model.onnx", "verify,cleanup", tmp_path / "p", progress=False).plan_dir
    model = dyncompile.load(plan)
    ids = gpt2_dir.tokenizer(PROMPT)["input_ids"]
    with caplog.at_level(logging.WARNING):
        res = model.generate(PROMPT, max_new_tokens=40)
    assert len(ids) + len(res.token_ids) == N_POSITIONS
    assert res.stats.stop_reason == "max_length"
    assert any("position" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    ref = _greedy_ids(gpt2_dir.model, ids, N_POSITIONS - len(ids), eos_token_id=None, pad_token_id=0)
    assert res.token_ids == ref


def test_generate_on_a_list_of_prompts(gpt2_plan):
    model = dyncompile.load(gpt2_plan)
    one = model.generate(PROMPT, max_new_tokens=3)
    many = model.generate([PROMPT, "a good film"], max_new_tokens=3)
    assert isinstance(many, list) and len(many) == 2
    assert many[0].token_ids == one.token_ids


# ------------------------------------------------------------------------------------------ familiar APIs


def test_pipeline_text_classification_matches_transformers(bert_dir, bert_plan):
    ref = transformers.pipeline("text-classification", model=bert_dir.model, tokenizer=bert_dir.tokenizer)
    pipe = dyncompile.pipeline("text-classification", bert_plan)
    texts = ["a good movie", "the plot was boring and long"]
    for kw in ({}, {"top_k": None}, {"top_k": 2}):
        for x in (texts[0], texts):
            want, got = ref(x, **kw), pipe(x, **kw)
            assert json.dumps(_rounded(got)) == json.dumps(_rounded(want)), (kw, x)


def test_pipeline_from_a_model_folder(bert_dir):
    pipe = dyncompile.pipeline("text-classification", bert_dir.path)
    out = pipe("a good movie")
    assert isinstance(out, list) and set(out[0]) == {"label", "score"}


def test_pipeline_text_generation_matches_transformers(gpt2_dir, gpt2_plan):
    ref = transformers.pipeline("text-generation", model=gpt2_dir.model, tokenizer=gpt2_dir.tokenizer)
    pipe = dyncompile.pipeline("text-generation", gpt2_plan)
    for x in (PROMPT, [PROMPT, "a good film"]):
        for kw in ({"max_new_tokens": 4}, {"max_new_tokens": 4, "return_full_text": False}):
            assert pipe(x, **kw) == ref(x, do_sample=False, **kw), (x, kw)


def test_pipeline_refuses_a_task_the_plan_is_not(bert_plan):
    from dyncompile.errors import DyncompileError

    with pytest.raises(DyncompileError, match="text-classification"):
        dyncompile.pipeline("text-generation", bert_plan)


def test_ort_model_for_sequence_classification(bert_dir, bert_plan):
    model = dyncompile.ORTModelForSequenceClassification.from_pretrained(bert_plan)
    enc = bert_dir.tokenizer(["a good movie", "bad"], padding=True, return_tensors="pt")
    out = model(**enc)
    with torch.no_grad():
        want = bert_dir.model(**enc).logits
    assert isinstance(out.logits, torch.Tensor)
    np.testing.assert_allclose(out.logits.numpy(), want.numpy(), atol=1e-5)
    assert model.config.id2label == {0: "NEGATIVE", 1: "POSITIVE"}


def _rounded(x):
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    if isinstance(x, dict):
        return {k: round(v, 5) if isinstance(v, float) else v for k, v in x.items()}
    return x


def test_unknown_task_names_the_fix(capsys, bert_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(bert_dir.path, d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["architectures"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert run_cli(capsys, d, "-o", tmp_path / "p")[0] == 0
    rc, _, err = run_cli(capsys, "run", tmp_path / "p", "--text", "a good movie")
    assert_clean_error(rc, err, "'unknown'", "dyncompile-model.json", '"task"')


def test_chat_template_from_tokenizer_config(gpt2_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(gpt2_dir.path, d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["chat_template"] = "{% for m in messages %}the {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}a{% endif %}"
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    plan = compile_model(d, "verify,cleanup", tmp_path / "p", progress=False).plan_dir
    model = dyncompile.load(plan)
    res = model.generate("good movie", max_new_tokens=2, chat=True)
    assert res.prompt_ids == gpt2_dir.tokenizer("the good movie a")["input_ids"]


def test_pipeline_feature_extraction_matches_transformers(tmp_path):
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    d = tmp_path / "bert-base"
    d.mkdir()
    tok, n = _wordpiece()
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=n,
                     architectures=["BertModel"])
    model = BertModel(cfg).eval()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=MAX_LEN, pad_token="[PAD]",
                                     unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                     model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    hf_tok.save_pretrained(d)
    cfg.save_pretrained(d)

    class Hidden(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.model = m

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    names = ("input_ids", "attention_mask", "token_type_ids")
    ex = hf_tok(["good movie", "bad plot and acting"], padding=True, return_tensors="pt")
    b, s = torch.export.Dim("batch"), torch.export.Dim("seq")
    _export(Hidden(model), tuple(ex[k] for k in names), names, ["last_hidden_state"],
            {k: {0: b, 1: s} for k in names}, d / "model.onnx")
    ref = transformers.pipeline("feature-extraction", model=model, tokenizer=hf_tok)
    pipe = dyncompile.pipeline("feature-extraction", d)
    for x in ("a good movie", ["a good movie", "bad"]):
        got, want = pipe(x), ref(x)
        assert _shape(got) == _shape(want)
        np.testing.assert_allclose(_flat(got), _flat(want), atol=1e-5)

    # the same folder as a sentence-transformers model (mean pooling, then Normalize): a sentence-embedding plan
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32,
                                                             "pooling_mode_mean_tokens": True}))
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))
    plan = dyncompile.compile(d, "verify,cleanup", tmp_path / "st", progress=False).plan_dir
    m = dyncompile.load(plan)
    assert m.plan.task == "sentence-embedding"
    texts = ["a good movie", "bad plot and acting"]
    enc = hf_tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    w = enc["attention_mask"].unsqueeze(-1).float()
    want = torch.nn.functional.normalize((h * w).sum(1) / w.sum(1), dim=-1).numpy()
    np.testing.assert_allclose(m.encode(texts), want, atol=1e-5)


def _flat(x) -> np.ndarray:
    return np.concatenate([np.asarray(r, np.float64).reshape(-1) for r in (x if isinstance(x[0][0][0], list) else [x])])


def _shape(x) -> list[int]:
    out = []
    while isinstance(x, list):
        out.append(len(x))
        x = x[0]
    return out
