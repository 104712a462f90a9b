"""Sentence embeddings: a sentence-transformers folder (encoder + pooling config) exports to a ``sentence-embedding``
model whose plan records the pooling; ``model.encode(texts)`` equals mean pooling + normalize computed in torch on
the same model (<= 1e-5); ``run --text`` prints each vector's dims and norm; early exit is refused with the reason;
a hostile ``policy.pooling`` is one error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_clean_error, run_cli

import dyncompile
from dyncompile.errors import DyncompileError, PassConfigError, PlanError
from dyncompile.plan import load_plan, pooling_from_sentence_transformers

TEXTS = ["the cat sat on the mat", "a dog", "the mat sat on a cat and the dog sat too"]
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "and", "too"]


def _st_folder(root: Path, *, mode: str = "mean", normalize: bool = True) -> Path:
    """A tiny random-init BertModel saved as a sentence-transformers folder (modules.json, 1_Pooling/config.json)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = root / "st-model"
    folder.mkdir(parents=True)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    tok = transformers.BertTokenizerFast(vocab_file=str(vocab), do_lower_case=True)
    tok.save_pretrained(str(folder))
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64)
    transformers.BertModel(cfg, add_pooling_layer=False).eval().save_pretrained(str(folder))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_max_tokens": mode == "max",
        "pooling_mode_mean_sqrt_len_tokens": False}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16, "do_lower_case": False}))
    return folder


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """(sentence-transformers folder, exported model folder, compiled plan directory)."""
    from dyncompile.models._embeddings import export_sentence_embedder

    root = tmp_path_factory.mktemp("embed")
    folder = _st_folder(root)
    work = root / "export"
    work.mkdir()
    cfg = export_sentence_embedder(folder, work, name="tiny-embedder")
    (work / "dyncompile-model.json").write_text(json.dumps(cfg))
    plan_dir = dyncompile.compile(work / "model.onnx", "verify,cleanup", root / "plan").plan_dir
    return folder, work, plan_dir


def _torch_reference(folder: Path, texts: list[str]) -> np.ndarray:
    """Mean pooling over kept tokens + L2 normalize, in torch, on the HF folder's own model and tokenizer."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModel.from_pretrained(str(folder)).eval()
    enc = tok(texts, padding=True, truncation=True, max_length=16, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(mean, p=2, dim=1).numpy()


def test_pooling_is_read_from_the_sentence_transformers_config(tmp_path):
    folder = _st_folder(tmp_path / "a")
    got = pooling_from_sentence_transformers(folder)
    assert (got["mode"], got["normalize"], got["dimension"]) == ("mean", True, 32)
    cls = pooling_from_sentence_transformers(_st_folder(tmp_path / "b", mode="cls", normalize=False))
    assert (cls["mode"], cls["normalize"]) == ("cls", False)
    assert pooling_from_sentence_transformers(tmp_path) is None  # no sentence-transformers config: not one
    bad = json.loads((folder / "1_Pooling" / "config.json").read_text())
    bad["pooling_mode_lasttoken"] = True
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(DyncompileError, match="pooling_mode_lasttoken"):
        pooling_from_sentence_transformers(folder)


def test_plan_records_the_pooling(embedder):
    _, _, plan_dir = embedder
    plan = load_plan(plan_dir)
    assert plan.task == "sentence-embedding"
    assert plan.policy["pooling"]["mode"] == "mean" and plan.policy["pooling"]["normalize"] is True


def test_encode_equals_torch_mean_pooling_and_normalize(embedder):
    folder, _, plan_dir = embedder
    m = dyncompile.load(plan_dir)
    got = m.encode(TEXTS)
    ref = _torch_reference(folder, TEXTS)
    assert got.shape == (len(TEXTS), 32)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(m.encode(TEXTS, batch_size=1), got, atol=1e-5, rtol=0)  # padding does not leak in


def test_cli_run_text_prints_dims_and_norm(embedder, capsys):
    _, _, plan_dir = embedder
    rc, out, err = run_cli(capsys, "run", plan_dir, "--text", TEXTS[0], "--text", TEXTS[1])
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 2 and all("dims=32" in line and "norm=1.0000" in line for line in lines)


def test_early_exit_on_an_embedding_model_is_refused_with_the_reason(embedder, tmp_path):
    _, work, _ = embedder
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": t, "label": 0}) + "\n" for t in TEXTS))
    with pytest.raises(PassConfigError, match="early-exit cannot run on a sentence-embedding model") as err:
        dyncompile.compile(work / "model.onnx", "early-exit", tmp_path / "ee", calib=str(calib))
    assert "cosine" in str(err.value)


@pytest.mark.parametrize("pooling, needle", [
    ({"mode": "median", "normalize": True}, "policy.pooling.mode"),
    ({"mode": "mean", "normalize": "yes"}, "policy.pooling.normalize"),
    ({"mode": "mean", "output": "logits"}, "policy.pooling.output"),
])
def test_hostile_pooling_policy_is_one_error(embedder, tmp_path, capsys, pooling, needle):
    _, _, plan_dir = embedder
    copy = tmp_path / "plan"
    shutil.copytree(plan_dir, copy)
    raw = json.loads((copy / "plan.json").read_text())
    raw["policy"]["pooling"] = pooling
    (copy / "plan.json").write_text(json.dumps(raw))
    with pytest.raises(PlanError, match=needle.replace(".", r"\.")):
        dyncompile.load(copy).encode(TEXTS)
    rc, _, err = run_cli(capsys, "run", copy, "--text", "a dog")
    assert_clean_error(rc, err, needle)


def test_real_minilm_embeddings_equal_torch(minilm_embedding, tmp_path):
    """all-MiniLM-L6-v2 (recipe minilm-l6-embedding): encode() equals torch mean pooling + normalize."""
    model_dir = minilm_embedding.onnx_path.parent
    cfg = json.loads((model_dir / "dyncompile-model.json").read_text())
    plan_dir = dyncompile.compile(model_dir / "model.onnx", "verify", tmp_path / "plan").plan_dir
    got = dyncompile.load(plan_dir).encode(TEXTS)
    assert got.shape == (len(TEXTS), 384)
    np.testing.assert_allclose(got, _torch_reference(Path(cfg["hf_dir"]), TEXTS), atol=1e-5, rtol=0)


def test_plan_without_pooling_loads_and_encode_says_what_is_missing(embedder, tmp_path):
    _, _, plan_dir = embedder
    copy = tmp_path / "plan"
    shutil.copytree(plan_dir, copy)
    raw = json.loads((copy / "plan.json").read_text())
    del raw["policy"]["pooling"]
    (copy / "plan.json").write_text(json.dumps(raw))
    m = dyncompile.load(copy)
    with pytest.raises(PlanError, match="records no policy.pooling"):
        m.encode(TEXTS)
