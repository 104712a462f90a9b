"""``dyncompile serve`` on Ray Serve, with real clients: the official ``openai`` client (streaming and not) on a
decoder plan, token-identical to ``dyncompile.load(plan).generate``; plain HTTP (urllib) for classify (a staged
early-exit plan and a routed cascade, batched with ``@serve.batch``) and images (a tiny text-to-image plan);
``/health`` and ``/metrics``; bad requests as one 400 with a message; an overloaded deployment answering 503
rather than hanging. One Ray + Serve instance for the module (started once, shut down at the end).

The streaming iterator under the server (``CompiledModel.generate_stream``) and the stop-string cutter are
tested without Ray too.
"""

from __future__ import annotations

import base64
import json
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import dyncompile

VOCAB = 64
EOS = VOCAB - 1
PROMPT = "w1 w2 w3 w4 w1 w2 w3"
CHAT_TEMPLATE = ("{% for m in messages %}w{{ 10 + loop.index }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w9{% endif %}")
TEXTS = ["w3 w5 w7 w9", "w1 w2", "w8 w8 w8 w2 w4 w6", "w11 w12 w13", "w5", "w20 w21 w22 w23 w24"]


def _decoder_plan(root: Path, passes: str, name: str) -> Path:
    from dyncompile.models.synthetic_decoder import tiny_decoder, write_decoder_dir, write_word_tokenizer

    d = root / f"{name}-model"
    path = write_decoder_dir(d, tiny_decoder(num_layers=2, vocab=VOCAB, seed=0), eos=EOS, chat_template=CHAT_TEMPLATE)
    write_word_tokenizer(d, VOCAB)
    return dyncompile.compile(path, passes, root / name, drafter="prompt-lookup", progress=False).plan_dir


@pytest.fixture(scope="module")
def plans(module_tmp) -> dict[str, Path]:
    from hostile_plans import routed_plan, staged_plan, word_calib
    from test_concurrency import _diffusion_plan

    root = module_tmp("serve")
    out = {"ee": staged_plan(root / "ee"), "pl": _decoder_plan(root, "speculative{measure=false}", "pl"),
           "img": _diffusion_plan(root / "img")}
    from hostile_plans import classifier_dir, run_model_plan

    plain = run_model_plan(classifier_dir(root / "cls-model"), root / "plain")
    out["routed"] = routed_plan([plain, out["ee"]], root / "routed", word_calib(root / "calib.jsonl", n=40))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(plans):
    """Ray + Serve for the module: every plan at /<name>, plus a deployment with a one-request queue at /tight."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from dyncompile.tools.serve import ServeOptions, build_app, start, stop

    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        # a long batch wait: concurrent classify requests share batches whatever the machine's speed
        urls = start([plans[k] for k in ("ee", "pl", "img", "routed")],
                     ServeOptions(port=port, replica_cpus=0, max_batch_size=8, batch_wait_ms=150))
        tight = ServeOptions(port=port, replica_cpus=0, max_ongoing_requests=1, max_queued_requests=1)
        serve.run(build_app(plans["pl"], tight, name="tight"), name="tight", route_prefix="/tight")
        urls["tight"] = f"http://127.0.0.1:{port}/tight"
        yield urls
    finally:
        stop()
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def local(plans):
    """The plans loaded in this process: the references the server's answers must equal."""
    return {k: dyncompile.load(v) for k, v in plans.items()}


def _post(url: str, body, timeout: float = 60.0) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:  # Ray Serve's own answers (503 when the queue is full) are plain text
            return e.code, {"text": raw.decode(errors="replace")}


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.read().decode()


def _client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server["pl"] + "/v1", api_key="none", max_retries=0, timeout=60)


# ------------------------------------------------------------------------------------------- decoder (openai)


def test_openai_completion_is_token_identical_to_generate(server, local):
    ref = local["pl"].generate(PROMPT, max_new_tokens=24)
    res = _client(server).completions.create(model="pl", prompt=PROMPT, max_tokens=24, temperature=0)
    assert res.model_extra["dyncompile"]["token_ids"] == ref.token_ids
    assert res.choices[0].text == ref.text
    assert res.choices[0].finish_reason == ("length" if ref.stats.stop_reason == "max_new_tokens" else "stop")
    assert res.usage.completion_tokens == len(ref.token_ids) and res.usage.prompt_tokens == len(ref.prompt_ids)
    target = local["pl"].generate(PROMPT, max_new_tokens=24, speculative=False)
    assert target.token_ids == ref.token_ids  # speculative decoding under the server keeps the target's tokens


def test_openai_streaming_gives_the_same_text(server, local):
    ref = local["pl"].generate(PROMPT, max_new_tokens=24)
    chunks = list(_client(server).completions.create(model="pl", prompt=PROMPT, max_tokens=24, temperature=0,
                                                     stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1  # streamed in pieces, not one
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_openai_chat_streaming_and_not_use_the_plan_template(server, local):
    ref = local["pl"].generate("w5 w6 w7", max_new_tokens=12, chat=True)
    client = _client(server)
    msgs = [{"role": "user", "content": "w5 w6 w7"}]
    res = client.chat.completions.create(model="pl", messages=msgs, max_tokens=12, temperature=0)
    assert res.choices[0].message.content == ref.text and res.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="pl", messages=msgs, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    # a conversation goes through the same sandboxed template
    conv = [{"role": "system", "content": "w2"}, {"role": "user", "content": "w5 w6 w7"}]
    rendered = "w11 w2 w12 w5 w6 w7 w9"
    assert client.chat.completions.create(model="pl", messages=conv, max_tokens=8, temperature=0).choices[0] \
        .message.content == local["pl"].generate(rendered, max_new_tokens=8).text


def test_sampling_uses_the_plans_exact_sampler_and_seed(server, local):
    ref = local["pl"].generate(PROMPT, max_new_tokens=16, sample=True, temperature=0.8, seed=7)
    res = _client(server).completions.create(model="pl", prompt=PROMPT, max_tokens=16, temperature=0.8, seed=7)
    assert res.model_extra["dyncompile"]["token_ids"] == ref.token_ids


def test_stop_strings_cut_the_text_streaming_and_not(server, local):
    full = local["pl"].generate(PROMPT, max_new_tokens=24).text
    words = full.split()
    stop = words[3]  # a word inside the continuation; OpenAI leaves the stop string out
    expect = full[: full.index(stop)]
    client = _client(server)
    res = client.completions.create(model="pl", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert res.choices[0].text == expect and res.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="pl", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expect


@pytest.mark.parametrize("kwargs, message", [
    ({"top_p": 0.5}, "top_p=0.5 is not supported"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"n": 2}, "n=2 is not supported"),
    ({"temperature": 3.0}, "temperature must be a number in [0, 2]"),
])
def test_bad_completion_requests_are_one_400(server, kwargs, message):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).completions.create(model="pl", prompt=PROMPT, **{"max_tokens": 4, **kwargs})
    assert e.value.status_code == 400 and message in e.value.message


def test_bad_http_bodies_are_one_400_and_wrong_endpoints_404(server):
    code, body = _post(server["pl"] + "/v1/completions", b"{not json")
    assert code == 400 and "not JSON" in body["error"]["message"]
    code, body = _post(server["pl"] + "/v1/completions", {"prompt": ""})
    assert code == 400 and "prompt must be a non-empty string" in body["error"]["message"]
    code, body = _post(server["ee"] + "/v1/classify", {"input": []})
    assert code == 400 and "input must be a string or a non-empty list" in body["error"]["message"]
    code, body = _post(server["ee"] + "/v1/classify", {"input": ["w1"] * 9})
    assert code == 400 and "at most 8 texts per request" in body["error"]["message"]
    code, body = _post(server["ee"] + "/v1/completions", {"prompt": "w1"})
    assert code == 404 and "/v1/classify" in body["error"]["message"]


def test_overload_is_answered_503_not_a_hang(server):
    """One request at a time and one waiting: the rest of a burst get 503 at once; every request is answered."""
    def one(_):
        try:
            return _post(server["tight"] + "/v1/completions", {"prompt": PROMPT, "max_tokens": 400,
                                                                "temperature": 0}, timeout=120)[0]
        except Exception as e:  # noqa: BLE001 - a hang or a dropped connection fails below
            return repr(e)

    with ThreadPoolExecutor(12) as ex:
        codes = list(ex.map(one, range(12)))
    assert set(codes) <= {200, 503}, codes
    assert codes.count(200) >= 1 and codes.count(503) >= 1, codes


# ------------------------------------------------------------------------------------------- classify, images


def test_classify_batches_requests_and_answers_like_the_plan(server, local):
    ref = local["ee"].classify(TEXTS)
    with ThreadPoolExecutor(len(TEXTS)) as ex:
        answers = list(ex.map(lambda t: _post(server["ee"] + "/v1/classify", {"input": t}), TEXTS))
    for (code, body), r in zip(answers, ref):
        assert code == 200, body
        row = body["data"][0]
        assert row["label"] == r.label and row["exit_layer"] == r.exit_layer
        np.testing.assert_allclose(list(row["probabilities"].values()), list(r.probabilities.values()), atol=1e-5)
    code, body = _post(server["ee"] + "/v1/classify", {"input": TEXTS[:3]})
    assert code == 200 and [d["label"] for d in body["data"]] == [r.label for r in ref[:3]]
    _, metrics = _get(server["ee"] + "/metrics")
    counts = {line.split()[0].split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith(("dyncompile_batch_rows_count", "dyncompile_rows_total", "dyncompile_exit_layer_count"))}
    assert counts["dyncompile_rows_total"] == len(TEXTS) + 3 == counts["dyncompile_exit_layer_count"]
    assert counts["dyncompile_batch_rows_count"] < len(TEXTS) + 1  # requests shared batches
    assert 'endpoint="/v1/classify"' in metrics and "dyncompile_request_seconds_bucket" in metrics


def test_routed_plan_is_served_like_its_candidates(server, local):
    ref = local["routed"].classify(TEXTS[:2])
    code, body = _post(server["routed"] + "/v1/classify", {"input": TEXTS[:2]})
    assert code == 200
    assert [(d["label"], d["candidate"]) for d in body["data"]] == [(r.label, r.candidate) for r in ref]


def test_images_are_the_plans_pngs(server, local):
    from dyncompile.runtime.diffusion.png import png_bytes

    ref = local["img"].generate_images(["w3 w4"] * 2, seed=5)
    code, body = _post(server["img"] + "/v1/images/generations", {"prompt": "w3 w4", "n": 2, "seed": 5})
    assert code == 200, body
    got = [base64.b64decode(d["b64_json"]) for d in body["data"]]
    assert got == [png_bytes(np.asarray(i)[..., 0] if np.asarray(i).ndim == 3 and np.asarray(i).shape[-1] == 1
                             else i) for i in ref.images]
    assert got[0].startswith(b"\x89PNG")
    code, body = _post(server["img"] + "/v1/images/generations", {"prompt": "w3", "response_format": "url"})
    assert code == 400 and "b64_json" in body["error"]["message"]


def test_health_models_and_metrics(server):
    code, text = _get(server["pl"] + "/health")
    health = json.loads(text)
    assert code == 200 and health["kind"] == "generate" and "/v1/chat/completions" in health["endpoints"]
    assert json.loads(_get(server["pl"] + "/v1/models")[1])["data"][0]["id"] == "pl"
    _client(server).completions.create(model="pl", prompt=PROMPT, max_tokens=8, temperature=0)
    _, metrics = _get(server["pl"] + "/metrics")
    for name in ("dyncompile_requests_total", "dyncompile_generated_tokens_total", "dyncompile_acceptance_rate",
                 "dyncompile_time_per_output_token_seconds_bucket"):
        assert name in metrics, name


# ------------------------------------------------------------------------------------------- without Ray


@pytest.mark.parametrize("speculative", [False, True])
def test_generate_stream_yields_generates_tokens(local, speculative):
    m = local["pl"]
    ref = m.generate(PROMPT, max_new_tokens=20, speculative=speculative)
    stream = m.generate_stream(PROMPT, max_new_tokens=20, speculative=speculative)
    pieces = list(stream)
    assert [t for p in pieces for t in p] == ref.token_ids == stream.result.token_ids
    assert len(pieces) > 1 and stream.result.stats.stop_reason == ref.stats.stop_reason


def test_generate_stream_close_stops_early_and_errors_surface(local):
    m = local["pl"]
    stream = m.generate_stream(PROMPT, max_new_tokens=200, speculative=False)
    first = next(stream)
    stream.close()
    rest = list(stream)
    assert 0 < len(first) + sum(map(len, rest)) < 200
    with pytest.raises(dyncompile.errors.DataError, match="max_new_tokens must be >= 1"):
        list(m.generate_stream(PROMPT, max_new_tokens=0))


def test_stop_cutter():
    from dyncompile.tools.serve.protocol import StopCutter

    c = StopCutter(["STOP"])  # holds back 3 characters: they could start "STOP"
    sent = "".join(c.feed(t) for t in ("he", "hello S", "hello STO", "hello STOP and more"))
    assert sent == "hello " and c.cut
    c = StopCutter([])
    assert "".join(c.feed(t) for t in ("a", "ab\ufffd", "abc")) + c.feed("abcd", final=True) == "abcd"


def test_serve_cli_bad_plan_is_one_error(tmp_path, capsys):
    from dyncompile.tools.cli import main

    rc = main(["serve", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "not a plan folder" in err and "Traceback" not in err


def test_serve_memory_option():
    from dyncompile.errors import DataError
    from dyncompile.tools.serve.options import ServeOptions

    assert ServeOptions().replica_memory == "arena"  # rows are batched: ORT's arena
    assert ServeOptions(max_batch_size=1).replica_memory == "auto"
    assert ServeOptions(memory="malloc").replica_memory == "malloc"
    with pytest.raises(DataError, match="serve option memory must be one of auto, arena, malloc, got 'pool'"):
        ServeOptions(memory="pool")


def test_serve_cli_bad_memory_is_one_error(tmp_path, capsys):
    from dyncompile.tools.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", str(tmp_path), "--memory", "pool"])
    assert e.value.code == 2 and "invalid choice: 'pool'" in capsys.readouterr().err
