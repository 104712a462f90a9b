"""tools/studies/restore_decoder_data.py: a recipe decoder's fp32 weights rebuilt from its GGUF (how the GPU machine gets
the models it cannot receive), byte for byte, and refused when a weight lands in the wrong place."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")


def test_restore_rebuilds_the_recipe_weights_byte_for_byte(smollm2, tmp_path):
    from dyncompile.io import sha256_file as _sha
    from dyncompile.models._core import model_home
    from dyncompile.models._decoders import SMOLLM2, assemble_gguf
    from dyncompile.tools.studies.restore_decoder_data import make_map, restore

    src = smollm2.onnx_path.parent
    entry = make_map([str(src)])[src.name]
    transposed = [r for r in entry["rows"] if r[4] == "T"]
    assert transposed and len(entry["rows"]) > len(transposed)  # folded transposes and plain weights both mapped
    (tmp_path / "map.json").write_text(json.dumps({src.name: entry}))
    gguf = assemble_gguf(SMOLLM2, model_home() / "downloads")[0]

    target = tmp_path / src.name
    target.mkdir()
    shutil.copy(src / "model.onnx", target / "model.onnx")
    digest = restore(str(target), str(gguf), str(tmp_path / "map.json"), None)
    assert digest == _sha(src / "model.onnx.data") == _sha(target / "model.onnx.data")

    # negative control: two same-shaped weights swapped in the map -> refused, nothing written
    rows = entry["rows"]
    i, j = next((a, b) for a in range(len(rows)) for b in range(a + 1, len(rows))
                if rows[a][2] == rows[b][2] and rows[a][3] != rows[b][3])
    rows[i][3:], rows[j][3:] = rows[j][3:], rows[i][3:]
    (tmp_path / "bad.json").write_text(json.dumps({src.name: entry}))
    bad = tmp_path / "bad" / src.name
    bad.mkdir(parents=True)
    shutil.copy(src / "model.onnx", bad / "model.onnx")
    with pytest.raises(SystemExit, match="differ from the recipe's build"):
        restore(str(bad), str(gguf), str(tmp_path / "bad.json"), None)
    assert not (bad / "model.onnx.data").exists()
    assert not list(bad.glob(".model.onnx.data.tmp-*"))
