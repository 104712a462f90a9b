"""``dyncompile serve PLAN...``: the parser and the command body."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from dyncompile.errors import DataError
from dyncompile.runtime.providers import MEMORY_MODES

logger = logging.getLogger(__name__)

__all__ = ["parser", "serve_command"]

EPILOG = """\
endpoints (one plan at /, several at /<plan folder name>):
  classifier plans      POST /v1/classify             {"input": "text" | ["text", ...]}
  decoder plans         POST /v1/completions          OpenAI completions (stream, stop, max_tokens, temperature, seed)
                        POST /v1/chat/completions     OpenAI chat completions, through the plan's chat template
  text-to-image plans   POST /v1/images/generations   {"prompt": "...", "n": 1, "seed": 0} -> PNG, base64
  embedding plans       POST /v1/embeddings           OpenAI embeddings
  every plan            GET /health, GET /v1/models, GET /metrics (Prometheus text)

examples:
  dyncompile serve ee/                                     # http://127.0.0.1:8000/v1/classify
  dyncompile serve ee/ pl/ --port 8080 --replicas 2        # /ee/v1/classify, /pl/v1/completions
  curl -s localhost:8000/v1/classify -d '{"input": "A gorgeous, witty movie."}'
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dyncompile serve",
        description="Serve compiled plans over HTTP on Ray Serve: one deployment per plan, replicas, dynamic "
        "batching and back-pressure (503 once the queue is full) from Ray Serve; OpenAI-compatible endpoints "
        "for decoders. Needs the serve extra: pip install 'dyncompile[serve]'.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("plans", nargs="+", metavar="PLAN_DIR", help="plan folders (classifier, decoder, text-to-image, "
                   "embedding or routed plans)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s; 0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default %(default)s)")
    p.add_argument("--replicas", type=int, default=1, help="replicas per plan (default %(default)s)")
    p.add_argument("--replica-cpus", type=float, default=1.0,
                   help="CPUs Ray reserves per replica, for placement (default %(default)s)")
    p.add_argument("--max-ongoing", type=int, dest="max_ongoing_requests",
                   help="requests a replica works on at once (default: 64 classify, 2 generation, 1 images)")
    p.add_argument("--max-queued", type=int, default=256, dest="max_queued_requests",
                   help="queued requests per deployment beyond which the answer is 503 (default %(default)s; -1: "
                   "unbounded)")
    p.add_argument("--max-batch-size", type=int, default=32, help="classify rows per batch (default %(default)s)")
    p.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="how long a batch waits for more rows (default %(default)s ms)")
    p.add_argument("--provider", default="cpu", help="execution provider of the replicas (default %(default)s)")
    p.add_argument("--threads", type=int, help="ORT intra-op threads per replica (default: ORT's choice)")
    p.add_argument("--spinning", action="store_true", help="ORT threads spin between work items (see `run`)")
    p.add_argument("--memory", choices=tuple(MEMORY_MODES),
                   help="how each replica's ORT sessions allocate (see `run --memory`); default: arena when rows are "
                   "batched (--max-batch-size > 1), else auto. malloc keeps a replica's memory near its model's size "
                   "(ORT's arena grows by a few hundred MiB over many batch shapes) at some batched speed")
    p.add_argument("--request-timeout", type=float, dest="request_timeout_s", help="HTTP request timeout, seconds")
    p.add_argument("--address", help="join a running Ray cluster (ray start --head ...) instead of starting Ray here")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


def serve_command(args: argparse.Namespace, *, block: bool = True) -> int:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise DataError("dyncompile serve needs Ray Serve: pip install 'dyncompile[serve]'") from None
    from dyncompile.tools.serve.app import start, stop
    from dyncompile.tools.serve.options import ServeOptions

    opts = ServeOptions(host=args.host, port=args.port, replicas=args.replicas, replica_cpus=args.replica_cpus,
                        max_ongoing_requests=args.max_ongoing_requests, max_queued_requests=args.max_queued_requests,
                        max_batch_size=args.max_batch_size, batch_wait_ms=args.batch_wait_ms, provider=args.provider,
                        threads=args.threads, spinning=args.spinning, memory=args.memory,
                        request_timeout_s=args.request_timeout_s, address=args.address)
    urls = start(args.plans, opts)
    for name, url in urls.items():
        print(f"serving {name} at {url}/", flush=True)
    if not block:
        return 0
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    print("Ctrl-C stops the server", file=sys.stderr, flush=True)
    done.wait()
    stop()
    return 0
