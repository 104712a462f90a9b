"""The Ray Serve deployment of one plan (FastAPI ingress) and starting/stopping Serve.

One deployment per plan; the deployment is its own HTTP ingress (no router hop): the only plan at ``/``, several
at ``/<name>``. Ray Serve does the replicas (``num_replicas``, placed on any node of the Ray cluster), the queueing
(``max_ongoing_requests`` per replica, ``max_queued_requests`` beyond which the proxy answers 503) and the dynamic
batching of classify/embeddings rows (``@serve.batch``). The model runs in a worker thread so that the replica's
event loop keeps forming the next batch (and answering ``/health``) meanwhile.
"""

# no `from __future__ import annotations`: FastAPI must see the real `Request` annotations of the ingress methods

import asyncio
import base64
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from dyncompile.errors import DyncompileError, PlanError
from dyncompile.tools.serve.metrics import ReplicaMetrics
from dyncompile.tools.serve.options import PlanInfo, ServeOptions, plan_info
from dyncompile.tools.serve.protocol import (
    RequestError,
    StopCutter,
    completion_request,
    error_body,
    finish_reason,
    texts_of,
)

logger = logging.getLogger(__name__)

__all__ = ["PlanServer", "build_app", "start", "stop"]

api = FastAPI(title="dyncompile serve", docs_url=None, redoc_url=None)


def _error(e: BaseException) -> JSONResponse:
    code = 500 if isinstance(e, PlanError) or not isinstance(e, DyncompileError) else 400
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    if code == 500:
        logger.error("request failed: %s: %s", type(e).__name__, msg)
    return JSONResponse(error_body(msg, code), status_code=code)


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not JSON ({e})") from None


def _replica_id() -> str:
    try:
        ctx = serve.get_replica_context()
        rid = getattr(ctx, "replica_id", None)
        return str(getattr(rid, "unique_id", None) or rid or getattr(ctx, "replica_tag", "0"))
    except Exception:  # noqa: BLE001 - outside a replica (unit use)
        return str(os.getpid())


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()[:12]
    except Exception:  # noqa: BLE001 - outside Ray
        return "local"


def _rss_mib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def _exits_of(model) -> list[int] | None:
    """The exit layers of an early-exit plan's calibration histogram (the drift guard's bins), or None."""
    from dyncompile.runtime.drift import calibration_distribution

    dist = calibration_distribution(model.plan.policy or {})
    return None if dist is None else dist[0]


def _codec(model):
    """The plan's text codec for decoding streamed tokens (None for routed plans: they answer in one piece)."""
    return next((h.codec for h in reversed(model.handlers) if hasattr(h, "generate_ids")), None)


def _chat_template(model) -> str | None:
    return next((h.gen.chat_template for h in reversed(model.handlers) if hasattr(h, "generate_ids")), None)


@serve.deployment
@serve.ingress(api)
class PlanServer:
    """One replica serving one plan.

    Args:
        info: the plan (folder, name, task, kind).
        options: the serve options (provider, threads, batching).
    """

    def __init__(self, info: PlanInfo, options: ServeOptions) -> None:
        import dyncompile

        self.info = info
        self.options = options
        self.model = dyncompile.load(info.path, provider=options.provider, threads=options.threads,
                                     spinning=options.spinning, memory=options.replica_memory)
        self.replica = _replica_id()
        self.where = f"{self.replica}@{_node_id()}"
        self.metrics = ReplicaMetrics(info.name, self.replica, _exits_of(self.model) if info.kind == "classify" else None)
        self.drift_ok = info.kind == "classify" and _exits_of(self.model) is not None
        self._rows.set_max_batch_size(options.max_batch_size)
        self._rows.set_batch_wait_timeout_s(options.batch_wait_ms / 1000.0)
        logger.info("replica %s serves %s (%s) from %s", self.replica, info.name, info.kind, info.path)

    # ------------------------------------------------------------------------------------- common

    def _wrong_kind(self, endpoint: str) -> JSONResponse:
        return JSONResponse(error_body(f"{endpoint}: plan {self.info.name} is a {self.info.task} plan; it answers "
                                       f"{', '.join(self._endpoints())}", 404), status_code=404)

    def _endpoints(self) -> list[str]:
        return {"classify": ["/v1/classify"], "embed": ["/v1/embeddings"],
                "generate": ["/v1/completions", "/v1/chat/completions"],
                "images": ["/v1/images/generations"]}[self.info.kind]

    async def _answer(self, endpoint: str, kind: str, work, request: Request):
        t0 = time.perf_counter()
        if self.info.kind != kind:
            resp: Response = self._wrong_kind(endpoint)
        else:
            try:
                resp = await work(await _json(request))
            except Exception as e:  # noqa: BLE001 - every failure is one JSON error
                resp = _error(e)
        self.metrics.request(endpoint, resp.status_code, time.perf_counter() - t0)
        resp.headers["x-dyncompile-replica"] = self.where
        return resp

    @api.get("/health")
    async def health(self) -> dict:
        """Liveness and what this replica serves."""
        return {"status": "ok", "plan": self.info.name, "task": self.info.task, "kind": self.info.kind,
                "replica": self.replica, "node": _node_id(), "pid": os.getpid(), "rss_mib": _rss_mib(),
                "endpoints": self._endpoints()}

    @api.get("/v1/models")
    async def models(self) -> dict:
        """OpenAI's model list: this plan."""
        return {"object": "list", "data": [{"id": self.info.name, "object": "model", "created": 0,
                                            "owned_by": "dyncompile"}]}

    @api.get("/metrics")
    async def metrics_text(self) -> Response:
        """Prometheus text: this replica's requests, latencies, exit layers, acceptance and drift alarm."""
        if self.drift_ok:
            try:
                self.metrics.drift(self.model.drift_report(warn=False))
            except DyncompileError:
                pass
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------------------------- classify / embed

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005, batch_size_fn=lambda reqs: sum(len(r) for r in reqs))
    async def _rows(self, requests: list[list[str]]) -> list[Any]:
        flat = [t for r in requests for t in r]
        if self.info.kind == "embed":
            out = await asyncio.to_thread(self.model.encode, flat, batch_size=len(flat))
            self.metrics.batch(len(flat))
        else:
            out = await asyncio.to_thread(self.model.classify, flat, batch_size=len(flat))
            exits = [p.exit_layer for p in out]
            self.metrics.batch(len(flat), exits if exits and exits[0] is not None else None)
        answers, i = [], 0
        for r in requests:
            answers.append(out[i:i + len(r)])
            i += len(r)
        return answers

    async def _classify(self, body: Any) -> JSONResponse:
        texts, _ = texts_of(body, limit=self.options.max_batch_size)
        preds = await self._rows(texts)
        data = []
        for i, p in enumerate(preds):
            row = {"index": i, "label": p.label, "score": p.score, "probabilities": p.probabilities,
                   "exit_layer": p.exit_layer}
            if p.candidate is not None:
                row["candidate"] = p.candidate
            data.append(row)
        return JSONResponse({"object": "list", "model": self.info.name, "data": data})

    @api.post("/v1/classify")
    async def classify(self, request: Request):
        """Labels, probabilities and exit layers of ``input`` (a text or a list), batched with other requests."""
        return await self._answer("/v1/classify", "classify", self._classify, request)

    async def _embed(self, body: Any) -> JSONResponse:
        texts, _ = texts_of(body, limit=self.options.max_batch_size)
        vecs = await self._rows(texts)
        data = [{"object": "embedding", "index": i, "embedding": np.asarray(v, np.float64).tolist()}
                for i, v in enumerate(vecs)]
        return JSONResponse({"object": "list", "model": self.info.name, "data": data,
                             "usage": {"prompt_tokens": 0, "total_tokens": 0}})

    @api.post("/v1/embeddings")
    async def embeddings(self, request: Request):
        """OpenAI's embeddings API on a sentence-embedding plan (batched like classify)."""
        return await self._answer("/v1/embeddings", "embed", self._embed, request)

    # ------------------------------------------------------------------------------------- generation

    def _prompt(self, req) -> tuple[Any, bool]:
        """What ``generate`` gets: the text or ids, and ``chat`` (a single user turn goes through the plan's
        chat template inside the runtime; a conversation is rendered here by the same sandbox)."""
        if not req.chat:
            return req.prompt, False
        msgs = req.prompt
        if len(msgs) == 1 and msgs[0]["role"] == "user":
            return msgs[0]["content"], True
        from dyncompile.runtime.text import ChatTemplateError, render_chat

        template = _chat_template(self.model)
        try:
            return render_chat(template, msgs), False
        except ChatTemplateError as e:
            raise RequestError(str(e)) from None

    def _choice(self, req, text: str, reason: str) -> dict:
        if req.chat:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                    "logprobs": None}
        return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

    async def _complete(self, body: Any, chat: bool) -> Response:
        req = completion_request(body, chat=chat)
        prompt, use_chat = self._prompt(req)
        kwargs = {**req.generate_kwargs(), "chat": use_chat}
        if req.stream:
            return await self._stream(req, prompt, kwargs)
        res = await asyncio.to_thread(self.model.generate, prompt, **kwargs)
        self.metrics.generation(res.stats)
        cutter = StopCutter(req.stop)
        text = cutter.full(res.text if res.text is not None else " ".join(map(str, res.token_ids)))
        usage = {"prompt_tokens": len(res.prompt_ids), "completion_tokens": len(res.token_ids),
                 "total_tokens": len(res.prompt_ids) + len(res.token_ids)}
        return JSONResponse({
            "id": req.id, "object": "chat.completion" if chat else "text_completion", "created": req.created,
            "model": self.info.name, "choices": [self._choice(req, text, finish_reason(res.stats.stop_reason, cutter.cut))],
            "usage": usage, "dyncompile": {"token_ids": res.token_ids, "stats": res.stats.to_dict()},
        })

    def _chunk(self, req, delta: str | None, reason: str | None, first: bool = False) -> str:
        if req.chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if delta:
                d["content"] = delta
            choice = {"index": 0, "delta": d, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
        obj = {"id": req.id, "object": "chat.completion.chunk" if req.chat else "text_completion",
               "created": req.created, "model": self.info.name, "choices": [choice]}
        return f"data: {json.dumps(obj)}\n\n"

    async def _stream(self, req, prompt: Any, kwargs: dict) -> Response:
        t0 = time.perf_counter()
        stream = self.model.generate_stream(prompt, **kwargs)
        try:
            first = await asyncio.to_thread(next, stream, None)  # errors of the request: a 400 before any event
        except BaseException:
            stream.close()
            raise
        ttft = time.perf_counter() - t0
        self.metrics.ttft.labels(**self.metrics.labels).observe(ttft)
        codec = _codec(self.model)
        cutter = StopCutter(req.stop)

        async def events():
            ids: list[int] = []
            chunk = first
            try:
                if req.chat:
                    yield self._chunk(req, None, None, first=True)
                while chunk is not None:
                    ids.extend(chunk)
                    if codec is not None:
                        delta = cutter.feed(codec.decode(ids))
                        if delta:
                            yield self._chunk(req, delta, None)
                        if cutter.cut:
                            stream.close()
                            break
                    chunk = await asyncio.to_thread(next, stream, None)
                while stream.result is None and chunk is not None:  # cut: let the worker finish its round
                    chunk = await asyncio.to_thread(next, stream, None)
                res = stream.result
                if res is not None:
                    self.metrics.generation(res.stats)
                    text = res.text if res.text is not None else " ".join(map(str, res.token_ids))
                    tail = cutter.feed(text, final=True)
                    if tail:
                        yield self._chunk(req, tail, None)
                    yield self._chunk(req, None, finish_reason(res.stats.stop_reason, cutter.cut))
                    if req.include_usage:
                        n = len(res.token_ids)
                        usage = {"prompt_tokens": len(res.prompt_ids), "completion_tokens": n,
                                 "total_tokens": len(res.prompt_ids) + n}
                        yield "data: " + json.dumps({"id": req.id, "object": "chat.completion.chunk" if req.chat
                                                     else "text_completion", "created": req.created,
                                                     "model": self.info.name, "choices": [], "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"
            except Exception as e:  # noqa: BLE001 - after the 200 an error is one SSE event
                yield "data: " + json.dumps(error_body(str(e).splitlines()[0] if str(e) else type(e).__name__, 500)) + "\n\n"
            finally:
                stream.close()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        """OpenAI's completions API (``stream``, ``stop``, ``max_tokens``, ``temperature``, ``seed``)."""
        return await self._answer("/v1/completions", "generate", lambda b: self._complete(b, False), request)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        """OpenAI's chat completions API, through the plan's chat template (sandboxed)."""
        return await self._answer("/v1/chat/completions", "generate", lambda b: self._complete(b, True), request)

    # ------------------------------------------------------------------------------------- images

    async def _images(self, body: Any) -> JSONResponse:
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise RequestError("prompt must be a non-empty string")
        n = body.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 8:
            raise RequestError(f"n must be an integer in 1..8, got {n!r}")
        fmt = body.get("response_format", "b64_json")
        if fmt != "b64_json":
            raise RequestError(f"response_format {fmt!r} is not supported; use 'b64_json' (PNG, base64)")
        kw: dict[str, Any] = {"seed": body.get("seed", 0)}
        for key in ("steps", "guidance", "policy"):
            if body.get(key) is not None:
                kw[key] = body[key]
        res = await asyncio.to_thread(self.model.generate_images, [prompt] * n, **kw)
        from dyncompile.runtime.diffusion.png import png_bytes

        data = []
        for img in res.images:
            img = np.asarray(img)
            if img.ndim == 3 and img.shape[-1] == 1:
                img = img[..., 0]
            data.append({"b64_json": base64.b64encode(png_bytes(img)).decode("ascii"), "revised_prompt": prompt})
        self.metrics.images.labels(**self.metrics.labels).inc(len(data))
        self.metrics.unet_calls.labels(**self.metrics.labels).inc(int(res.unet_calls))
        return JSONResponse({"created": int(time.time()), "data": data, "dyncompile": res.to_dict()})

    @api.post("/v1/images/generations")
    async def images(self, request: Request):
        """OpenAI's image generation API on a text-to-image plan (PNG, base64; ``seed``/``steps`` extensions)."""
        return await self._answer("/v1/images/generations", "images", self._images, request)


# ----------------------------------------------------------------------------------------- building, starting


def build_app(plan_dir: str | Path | PlanInfo, options: ServeOptions | None = None, *, name: str | None = None):
    """The Ray Serve application of one plan: ``serve.run(build_app("ee/"), route_prefix="/")``."""
    options = options or ServeOptions()
    info = plan_dir if isinstance(plan_dir, PlanInfo) else plan_info(plan_dir, name)
    return PlanServer.options(
        name=f"plan-{info.name}",
        num_replicas=options.replicas,
        max_ongoing_requests=options.ongoing(info.kind),
        max_queued_requests=options.max_queued_requests,
        ray_actor_options={"num_cpus": options.replica_cpus},
    ).bind(info, options)


_STARTED_RAY = False


def start(plans, options: ServeOptions | None = None) -> dict[str, str]:
    """Serve each plan folder of ``plans`` (one deployment each; one plan at ``/``, several at ``/<name>``).

    Starts Ray in this process unless one is running (or ``options.address`` names a cluster) and Serve's HTTP
    proxy on ``options.host:options.port``; returns when every deployment is ready. Returns ``{name: base URL}``.
    """
    import ray

    global _STARTED_RAY
    options = options or ServeOptions()
    if isinstance(plans, str | Path):
        plans = [plans]
    infos = [plan_info(p) for p in plans]
    names = [i.name for i in infos]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise RequestError(f"two plans would be served under the same name {dup[0]!r}: give folders with "
                           "different names")
    if not ray.is_initialized():
        ray.init(address=options.address, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
        _STARTED_RAY = options.address is None
    http = {"host": options.host, "port": options.port}
    if options.request_timeout_s is not None:
        http["request_timeout_s"] = options.request_timeout_s
    serve.start(http_options=http)
    urls = {}
    for info in infos:
        prefix = "/" if len(infos) == 1 else f"/{info.name}"
        serve.run(build_app(info, options), name=info.name, route_prefix=prefix)
        urls[info.name] = f"http://{options.host}:{options.port}{prefix.rstrip('/')}"
    return urls


def stop(*, ray_too: bool = True) -> None:
    """Shut Serve down, and Ray when :func:`start` started it (and ``ray_too``)."""
    import ray

    global _STARTED_RAY
    if ray.is_initialized():
        serve.shutdown()
        if ray_too and _STARTED_RAY:
            ray.shutdown()
            _STARTED_RAY = False
