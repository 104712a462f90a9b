"""One generation backend in its own process, speaking JSON lines: the worker behind ``dyncompile bench peers``.

Run as a script with the backend's own Python (the peers clash with dyncompile's onnxruntime, so each lives in
its own virtual environment)::

    $DYNCOMPILE_PEER_VENVS/ortgenai/bin/python tools/bench/peer_worker.py --backend ortgenai --model DIR [--threads 2]
    $DYNCOMPILE_PEER_VENVS/ovgenai/bin/python  tools/bench/peer_worker.py --backend openvino --model DIR [--draft DIR]
    python -m dyncompile.tools.bench.peer_worker --backend dyncompile --model PLAN_DIR [--session-config k=v]

Protocol (stdout carries only protocol lines; everything the libraries print goes to stderr): one line
``{"ready": true, "backend", "version", "load_s", "settings"}`` after loading, then for every request line on
stdin ``{"ids": [...], "max_new_tokens": n, "mode": "greedy"|"spec"|"draft"|"ngram"}`` one reply
``{"ids": [new token ids], "prefill_s", "total_s", "stats"}`` (or ``{"error": "..."}``); a request
``{"encode": text, "chat": bool}`` (dyncompile backend) returns ``{"ids": prompt ids}``. Greedy always.

This file imports only the standard library and numpy at module level: it must run in a peer's environment
where dyncompile is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _protocol_stream():
    """Keep the real stdout for protocol lines; point fd 1 at stderr so C++ libraries' prints cannot corrupt it."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "w", buffering=1)


class OrtGenAI:
    """onnxruntime-genai: ``og.Generator`` greedy; ``ngram`` mode = its n-gram speculative decoding; a model folder
    whose genai_config.json has a ``model.draft`` section runs its draft-model speculative decoding in every mode."""

    def __init__(self, args):
        import onnxruntime_genai as og

        self.og = og
        self.version = og.__version__
        config = og.Config(args.model)
        if args.provider and args.provider != "cpu":  # e.g. a -e cpu export run on the CUDA EP
            config.clear_providers()
            config.append_provider(args.provider)
        if args.threads:
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": args.threads}}}}))
        self.model = og.Model(config)
        self.args = args
        self.settings = {"threads": args.threads, "provider": args.provider, "ngram_size": args.ngram_size, "max_draft_tokens": args.max_draft_tokens,
                         "session_options": "onnxruntime-genai defaults (intra-op spinning on)"}

    def generate(self, ids, n, mode):
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(ids) + n, do_sample=False)
        if mode == "ngram":
            params.set_speculative_options(ngram_size=self.args.ngram_size, max_draft_tokens=self.args.max_draft_tokens)
        elif mode == "draft":
            params.set_speculative_options(max_draft_tokens=self.args.max_draft_tokens)
        gen = og.Generator(self.model, params)
        t0 = time.perf_counter()
        gen.append_tokens(ids)
        t1 = time.perf_counter()
        while not gen.is_done():
            gen.generate_next_token()
        t2 = time.perf_counter()
        seq = [int(t) for t in gen.get_sequence(0)]
        stats = {}
        try:  # speculative statistics (a folder with model.draft or a speculative section speculates in every mode)
            s = gen.get_speculative_stats()
            if s.get("rounds"):
                stats = {k: s[k] for k in ("acceptance_rate", "target_forward_passes", "draft_tokens_accepted",
                                           "draft_tokens_proposed", "rounds") if k in s}
        except Exception:  # noqa: BLE001 - a plain generator has none
            pass
        return {"ids": seq[len(ids):], "prefill_s": t1 - t0, "total_s": t2 - t0, "stats": stats}


class OpenVINOGenAI:
    """OpenVINO GenAI ``LLMPipeline`` on CPU: greedy; ``draft`` = its speculative decoding with ``--draft``;
    ``ngram`` = its prompt lookup decoding."""

    def __init__(self, args):
        import openvino_genai as ov_genai

        self.ov_genai = ov_genai
        self.version = ov_genai.__version__
        props = {"INFERENCE_NUM_THREADS": args.threads} if args.threads else {}
        if args.ov_precision != "default":
            # the CPU plugin computes in bf16 by default where the CPU has bf16 instructions (AVX512_BF16, AMX),
            # whatever the IR's weight format: an fp32 comparison must ask for f32
            props["INFERENCE_PRECISION_HINT"] = args.ov_precision
        kw = {}
        if args.draft:
            kw["draft_model"] = ov_genai.draft_model(args.draft, "CPU", **props)
        if args.prompt_lookup:
            kw["prompt_lookup"] = True
        self.pipe = ov_genai.LLMPipeline(args.model, "CPU", **props, **kw)
        self.args = args
        self.props = props
        self._scorer = None
        self.settings = {"threads": args.threads, "draft": args.draft, "prompt_lookup": args.prompt_lookup,
                         "inference_precision": args.ov_precision,
                         "num_assistant_tokens": args.max_draft_tokens, "max_ngram_size": args.ngram_size,
                         "properties": "OpenVINO CPU plugin defaults"}

    def generate(self, ids, n, mode):
        import numpy as np
        import openvino as ov

        cfg = self.pipe.get_generation_config()
        cfg.max_new_tokens = n
        cfg.do_sample = False
        if mode == "draft":
            cfg.num_assistant_tokens = self.args.max_draft_tokens
        elif mode == "ngram":
            cfg.num_assistant_tokens = self.args.max_draft_tokens
            cfg.max_ngram_size = self.args.ngram_size
        inp = ov.Tensor(np.asarray([ids], dtype=np.int64))
        t0 = time.perf_counter()
        res = self.pipe.generate(inp, cfg)
        t = time.perf_counter() - t0
        pm = res.perf_metrics
        ttft = pm.get_ttft().mean / 1e3
        return {"ids": [int(x) for x in res.tokens[0]], "prefill_s": ttft, "total_s": t,
                "stats": {"generate_duration_s": pm.get_generate_duration().mean / 1e3}}


    def score(self, ids):
        """Teacher-forced next-token NLL and top-1 of every position but the last (``tools/bench/quality``): the
        IR's own logits in one call (the pipeline does not expose them), a fresh state each time."""
        import numpy as np
        import openvino as ov

        if self._scorer is None:
            core = ov.Core()
            self._scorer = core.compile_model(core.read_model(str(Path(self.args.model) / "openvino_model.xml")), "CPU",
                                              self.props)
        req = self._scorer.create_infer_request()
        n = len(ids)
        feeds = {"input_ids": np.asarray([ids], np.int64), "attention_mask": np.ones((1, n), np.int64),
                 "position_ids": np.arange(n, dtype=np.int64)[None], "beam_idx": np.zeros(1, np.int32)}
        names = {p.get_any_name() for p in self._scorer.inputs}
        res = req.infer({k: v for k, v in feeds.items() if k in names})
        logits = next(v for k, v in res.items() if "logits" in k.get_names()).astype(np.float64)[0, :-1]
        m = logits.max(-1, keepdims=True)
        lp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
        return {"nll": (-lp[np.arange(n - 1), ids[1:]]).tolist(), "top1": lp.argmax(-1).tolist()}


class Dyncompile:
    """A dyncompile plan: ``greedy`` = its target alone, ``spec`` = its speculative step."""

    def __init__(self, args):
        import dyncompile

        cfg = dict(kv.split("=", 1) for kv in args.session_config)
        self.model = dyncompile.load(args.model, provider=args.provider, threads=args.threads,
                                     session_config=cfg or None, cuda_graph=bool(args.cuda_graph))
        self.io_binding = bool(args.io_binding)
        self.version = dyncompile.__version__ if hasattr(dyncompile, "__version__") else "checkout"
        from dyncompile.runtime.providers import DEFAULT_SESSION_CONFIG

        self.settings = {"threads": args.threads, "session_config": {**DEFAULT_SESSION_CONFIG, **cfg},
                         "given": cfg or "dyncompile.load defaults", "provider": self.model.provider,
                         "io_binding": self.io_binding,
                         "cuda_graph": bool(getattr(self.model.handlers[-1], "target", None)
                                            and self.model.handlers[-1].target.cuda_graph)}

    def encode(self, text, chat):
        from dyncompile.runtime.decode.generate import prompt_ids_of

        h = self.model.handlers[-1]
        return {"ids": prompt_ids_of(text, h.codec, h.gen, chat=chat)}

    def generate(self, ids, n, mode):
        kw = {"io_binding": True} if self.io_binding else {}
        r = self.model.generate(ids, max_new_tokens=n, speculative=(mode != "greedy"), **kw)
        s = r.stats.to_dict()
        keep = {k: s[k] for k in ("acceptance_rate", "tokens_per_target_call", "target_calls", "drafted", "accepted",
                                  "rounds") if k in s}
        return {"ids": list(r.token_ids), "prefill_s": s["prefill_seconds"], "total_s": s["seconds"], "stats": keep}


BACKENDS = {"ortgenai": OrtGenAI, "openvino": OpenVINOGenAI, "dyncompile": Dyncompile}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=sorted(BACKENDS), required=True)
    p.add_argument("--model", required=True, help="model folder (peers) or plan directory (dyncompile)")
    p.add_argument("--draft", help="openvino: draft model folder (speculative decoding)")
    p.add_argument("--prompt-lookup", action="store_true", help="openvino: build the prompt-lookup pipeline")
    p.add_argument("--threads", type=int)
    p.add_argument("--ov-precision", default="f32", choices=["f32", "bf16", "f16", "default"],
                   help="openvino: the CPU plugin's INFERENCE_PRECISION_HINT (default f32; 'default' = the plugin's "
                   "own choice, bf16 on CPUs with bf16 instructions)")
    p.add_argument("--max-draft-tokens", type=int, default=4)
    p.add_argument("--ngram-size", type=int, default=3)
    p.add_argument("--provider", default="cpu", help="dyncompile: execution provider (cpu, cuda, openvino)")
    p.add_argument("--io-binding", action="store_true",
                   help="dyncompile: keep the KV cache in ORT values bound by IOBinding (on CUDA: in GPU memory)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="dyncompile: replay the target's one-token steps as CUDA graphs (dyncompile.load(cuda_graph=True))")
    p.add_argument("--session-config", action="append", default=[], metavar="KEY=VALUE",
                   help="dyncompile: ORT session config entry (repeatable)")
    args = p.parse_args(argv)
    out = _protocol_stream()
    t0 = time.perf_counter()
    try:
        backend = BACKENDS[args.backend](args)
    except Exception as e:  # noqa: BLE001 - reported to the orchestrator as one line
        out.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"[:2000]}) + "\n")
        return 1
    out.write(json.dumps({"ready": True, "backend": args.backend, "version": backend.version,
                          "load_s": round(time.perf_counter() - t0, 3), "settings": backend.settings}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            if "encode" in req:
                rep = backend.encode(req["encode"], bool(req.get("chat")))
            elif "score" in req:
                if not hasattr(backend, "score"):
                    raise ValueError(f"backend {args.backend} cannot score (only openvino)")
                rep = backend.score([int(t) for t in req["score"]])
            else:
                rep = backend.generate([int(t) for t in req["ids"]], int(req["max_new_tokens"]), req.get("mode", "greedy"))
        except Exception as e:  # noqa: BLE001
            rep = {"error": f"{type(e).__name__}: {e}"[:2000]}
        out.write(json.dumps(rep) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
