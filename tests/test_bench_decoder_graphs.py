"""bench_decoder_graphs builds its own ORT sessions: they must carry dyncompile.load's default session config
(threads stop spinning when a call returns), or idle sessions' spinning threads slow the one that steps (it
measured 2-3 interleaved sessions at twice their single-session step time with ORT's plain spinning)."""

from __future__ import annotations

from dyncompile.models.synthetic_decoder import tiny_decoder, write_decoder_dir
from dyncompile.runtime.providers import DEFAULT_SESSION_CONFIG
from dyncompile.tools.bench_decoder_graphs import _session


def test_bench_sessions_use_the_load_defaults(tmp_path):
    folder = write_decoder_dir(tmp_path / "d", tiny_decoder(num_layers=1, vocab=16, seed=0), eos=15)
    so = _session(folder, 1).get_session_options()  # write_decoder_dir returns the model path
    assert DEFAULT_SESSION_CONFIG  # the load default this test guards
    for k, v in DEFAULT_SESSION_CONFIG.items():
        assert so.get_session_config_entry(k) == v
