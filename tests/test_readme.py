"""The README is a user's document that stays true: short, and every command in it either runs here on tiny
generated models or is named as covered by `make demo`, `make test` or a named real-model test.

The commands are read from the README's ```bash blocks. `COVERAGE` says, for each one, how it is checked; a
README command missing from the table (or a table row missing from the README) fails the test, so neither can
drift. Commands marked "run" run in order, in one folder, through ``dyncompile.tools.cli.main`` with the
README's shell variables pointing at tiny models and data.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 300

RUN = "run"  # runs here, on tiny models; must exit 0
SET = "set"  # a shell assignment: the test binds the variable itself (VARIABLES below)

# command (as written in the README, comment stripped) -> (how it is checked, detail)
COVERAGE: dict[str, tuple[str, str]] = {
    # top of the README
    "dyncompile model.onnx --passes early-exit --calib calib.jsonl --budget 1.0 -o plan/": (RUN, ""),
    'dyncompile run plan/ --text "A gorgeous, witty movie."': (RUN, ""),
    'dyncompile run ee/ --text "A gorgeous, witty movie."': (RUN, ""),
    # install: what `make setup` (and so `make test`) does
    'pip install -e ".[cpu]"': ("make", "setup"),
    'pip install -e ".[cpu,export]"': ("make", "setup"),
    'pip install -e ".[openvino]"': ("make", "setup-openvino"),
    "make demo": ("make", "demo"),
    "make test": ("make", "test"),
    # early exit
    "dyncompile models build minilm-l6-sentiment": ("make", "demo"),
    "M=~/.cache/dyncompile/models/minilm-l6-sentiment/model.onnx": (SET, "M"),
    "D=../shared/data/sentiment": (SET, "D"),
    "dyncompile inspect $M": (RUN, ""),
    "dyncompile $M --passes early-exit --calib $D/movie-calib.jsonl --budget 1.0 -o ee/": (RUN, ""),
    "dyncompile inspect ee/": (RUN, ""),
    "dyncompile run ee/ --data $D/movie-test.jsonl --compare": (RUN, ""),
    "dyncompile bench classify ee/ --data $D/movie-test.jsonl": (RUN, ""),
    # speculative decoding
    "dyncompile models build qwen2.5-coder-0.5b": ("test", "tests/test_speculative_qwen.py"),
    "T=~/.cache/dyncompile/models/qwen2.5-coder-0.5b/model.onnx": (SET, "T"),
    "dyncompile $T --passes speculative --drafter prompt-lookup -o pl/": (RUN, ""),
    'dyncompile run pl/ --prompt "def fib(n):" --max-new-tokens 64': (RUN, ""),
    "dyncompile bench generate pl/ --prompts prompts.jsonl": (RUN, ""),
    "dyncompile $T -O 0 --passes speculative --drafter prompt-lookup -o pl-plain/": (RUN, ""),
    # diffusion: needs the real pipeline
    "dyncompile models build fashion-diffusion": ("test", "tests/test_diffusion.py"),
    "P=~/.cache/dyncompile/models/fashion-diffusion": (SET, "P"),
    'dyncompile $P --passes "step-saver" --calib prompts.jsonl -o ss/': ("test", "tests/test_step_saver.py"),
    'dyncompile run ss/ --prompt "an image of a bag" -o bag.png': ("test", "tests/test_step_saver.py"),
    # routing
    "dyncompile $MINILM -o minilm/": (RUN, ""),
    "dyncompile $MPNET -o mpnet/": (RUN, ""),
    "dyncompile route --candidates minilm/ mpnet/ --calib $D/movie-calib.jsonl --budget 1.0 -o routed/": (RUN, ""),
    'dyncompile run routed/ --text "A gorgeous, witty movie."': (RUN, ""),
    "dyncompile bench route routed/ --data $D/movie-test.jsonl": (RUN, ""),
    # serving: the server blocks; the tests start it and talk to it with curl's request and the openai client
    'pip install -e ".[cpu,serve]"': ("make", "setup"),
    "dyncompile serve ee/ pl/ --port 8000": ("test", "tests/test_serve.py"),
    "curl -s localhost:8000/ee/v1/classify -d '{\"input\": \"A gorgeous, witty movie.\"}'": ("test", "tests/test_serve.py"),
    # quantization
    'dyncompile $M --passes "quantize-int8{per_channel=true,keep_fp32=ffn-out},early-exit" '
    "--calib $D/movie-calib.jsonl -o q8ee/": (RUN, ""),
    "dyncompile $T --passes quantize-int4 -o int4/": (RUN, ""),
    "MP=~/.cache/dyncompile/models/mpnet-base-sentiment/model.onnx": (SET, "MP"),
    # trained heads distilled on --train-text (real MiniLM) and activations=mixed are tested apart; together they
    # are the quantized-certified study's round-9/10 MPNet plan
    'dyncompile $MP --passes "pack-matmuls,quantize-int8{format=dynamic,activations=mixed},early-exit{heads=trained}" '
    "--calib $D/movie-calib.jsonl --train-text $D/movie-train.jsonl --budget 1.0 -o mp-q8ee/":
        ("test", "tests/test_trained_exit_heads.py"),
    # the command line
    "dyncompile passes": (RUN, ""),
    "dyncompile inspect --verify ee/": (RUN, ""),
    "dyncompile export-genai pl-plain/ -o genai/": (RUN, ""),
}

TINY_VOCAB = 64
TINY_WORDS = [f"w{i}" for i in range(1, TINY_VOCAB)]


def readme_commands(text: str) -> list[str]:
    """The commands of the README's ```bash blocks, in order: comments stripped, `\\` continuations joined."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        pending = ""
        for raw in block.splitlines():
            line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
            if line.endswith("\\"):
                pending += line[:-1].strip() + " "
                continue
            line = (pending + line.strip()).strip()
            pending = ""
            if line:
                commands.append(line)
    return commands


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines (at most {MAX_LINES}): move detail into docs/ or bench-results/"


def test_every_readme_command_is_covered():
    """Each README command has a row in COVERAGE and each row is still in the README; what a row names exists."""
    commands = readme_commands(README.read_text())
    assert commands, "no ```bash blocks found in README.md"
    missing = [c for c in commands if c not in COVERAGE]
    assert not missing, f"README commands with no COVERAGE row (run them here or name what covers them): {missing}"
    stale = [c for c in COVERAGE if c not in commands]
    assert not stale, f"COVERAGE rows no longer in the README: {stale}"
    makefile = (ROOT / "Makefile").read_text()
    for cmd, (how, detail) in COVERAGE.items():
        if how == "make":
            assert re.search(rf"^{re.escape(detail)}:", makefile, flags=re.M), (cmd, f"no make target {detail!r}")
        elif how == "test":
            assert (ROOT / detail).is_file(), (cmd, f"{detail} does not exist")


def _classifier_dir(d: Path, *, layers: int, seed: int) -> Path:
    """A tiny BERT-shaped classifier folder as a model recipe writes one: model.onnx, tokenizer.json, config."""
    from dyncompile.models.synthetic import tiny_encoder_classifier
    from dyncompile.models.synthetic_decoder import write_word_tokenizer

    d.mkdir(parents=True)
    ir.save(tiny_encoder_classifier(num_layers=layers, hidden=256, vocab=TINY_VOCAB, seed=seed), d / "model.onnx")
    write_word_tokenizer(d, TINY_VOCAB)
    cfg = {
        "format": "dyncompile.model/v1", "name": f"tiny-classifier-{seed}", "task": "text-classification",
        "family": "bert", "labels": ["negative", "positive"], "max_length": 16, "num_layers": layers,
        "hidden_size": 256, "vocab_size": TINY_VOCAB, "head_pooling": "cls", "pad_token_id": 0,
        "inputs": ["input_ids", "attention_mask"], "outputs": ["logits"],
    }
    (d / "dyncompile-model.json").write_text(json.dumps(cfg))
    return d / "model.onnx"


def _write_rows(path: Path, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for _ in range(n):
            words = rng.choice(TINY_WORDS, size=int(rng.integers(3, 12)))
            f.write(json.dumps({"text": " ".join(words), "label": int(rng.integers(0, 2))}) + "\n")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder laid out for the README's commands, and the values of its shell variables."""
    from dyncompile.models.synthetic_decoder import tiny_decoder, write_decoder_dir, write_word_tokenizer

    root = tmp_path_factory.mktemp("readme")
    # the top-of-README names, literally: model.onnx (+ tokenizer, config) and calib.jsonl in the working folder
    _classifier_dir(root / "classifier", layers=4, seed=0)
    for f in (root / "classifier").iterdir():
        (root / f.name).write_bytes(f.read_bytes())
    data = root / "data"
    data.mkdir()
    _write_rows(data / "movie-calib.jsonl", 2000, seed=1)  # enough rows to certify a 1-point budget
    _write_rows(data / "movie-test.jsonl", 60, seed=2)
    (root / "calib.jsonl").write_bytes((data / "movie-calib.jsonl").read_bytes())
    decoder = write_decoder_dir(root / "decoder", tiny_decoder(num_layers=2, vocab=TINY_VOCAB, seed=0),
                               eos=TINY_VOCAB - 1)  # inside the vocabulary: export-genai requires it
    write_word_tokenizer(root / "decoder", TINY_VOCAB)
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": "w1 w2 w3 w4 w1 w2"}) + "\n" for _ in range(2))
    )
    variables = {
        "M": str(root / "classifier" / "model.onnx"),
        "D": str(data),
        "T": str(decoder),
        "MINILM": str(_classifier_dir(root / "cheap", layers=2, seed=3)),
        "MPNET": str(_classifier_dir(root / "large", layers=4, seed=4)),
    }
    return root, variables


def _expand(cmd: str, variables: dict[str, str]) -> list[str]:
    def sub(m):
        name = m.group(1)
        assert name in variables, f"README uses ${name}, which the test does not bind"
        return variables[name]

    return shlex.split(re.sub(r"\$([A-Z_][A-Z0-9_]*)", sub, cmd))


def test_readme_commands_run_on_tiny_models(workspace, monkeypatch, capsys):
    from dyncompile.tools.cli import main

    root, variables = workspace
    monkeypatch.chdir(root)
    for cmd in readme_commands(README.read_text()):
        how, detail = COVERAGE.get(cmd, (None, ""))
        if how != RUN:
            continue
        argv = _expand(cmd, variables)
        assert argv[0] == "dyncompile", cmd
        try:
            rc = main(argv[1:])
        except SystemExit as e:  # argparse rejecting a subcommand or flag this CLI does not have yet
            rc = e.code
        out, err = capsys.readouterr()
        assert rc == 0, f"README command failed: {cmd}\n{err[-2000:]}"
        assert "Traceback" not in err, cmd


def test_readme_links_resolve():
    """Every relative link of the README points at a file or folder of the repository."""
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    relative = [link.split("#", 1)[0] for link in links if not re.match(r"[a-z]+:", link)]
    assert relative, "no relative links found"
    broken = [link for link in relative if link and not (ROOT / link).exists()]
    assert not broken, f"README links to missing files: {broken}"
