"""cache-unet: the skip structure of a U-Net read from the graph, the full/shallow graph pair, the refresh
schedule in the denoising loop (refresh and reuse steps, rows leaving the batch), and the plan on the real
fashion-diffusion pipeline (caching off = the uncached plan's images)."""

from __future__ import annotations

import json
import logging
import types

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import dyncompile
from dyncompile.errors import PassConfigError, PlanError
from dyncompile.passes import _keys
from dyncompile.passes.unet_cache import CacheUNetFeaturesPass
from dyncompile.passes.unet_cache.cache_unet_pass import refresh_count
from dyncompile.passes.unet_cache.structure import find_skip_concats, node_macs, part_cost, shallow_model
from dyncompile.plan import FeatureCacheParams, Step, from_json
from dyncompile.runtime.diffusion.denoise import Denoiser, FeatureCache, StopRule
from dyncompile.runtime.rules.schedulers import make_scheduler

SCHED = {"_class_name": "DDIMScheduler", "num_train_timesteps": 1000, "beta_schedule": "linear",
         "timestep_spacing": "trailing", "set_alpha_to_one": True}
L, D = 3, 8  # text tokens, text width


def _tiny_unet(path, skips: bool = True, hw: int = 8, tokens: int = L, width: int = D):
    """A diffusers-shaped U-Net (8x8 -> 4x4 -> 2x2 and back, skip Concats, timestep embedding, text states in the
    deep part) exported by the TorchScript exporter like the asset; ``skips=False``: the same without skips."""
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Res(nn.Module):
        def __init__(self, cin, cout):
            super().__init__()
            self.c1, self.c2, self.t = nn.Conv2d(cin, cout, 3, padding=1), nn.Conv2d(cout, cout, 3, padding=1), nn.Linear(8, cout)
            self.skip = nn.Conv2d(cin, cout, 1)

        def forward(self, x, temb):
            h = torch.nn.functional.silu(self.c1(x)) + self.t(temb)[:, :, None, None]
            return self.c2(torch.nn.functional.silu(h)) + self.skip(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.cin = nn.Conv2d(1, 4, 3, padding=1)
            self.d0, self.d1, self.mid = Res(4, 4), Res(4, 6), Res(6, 6)
            self.down0, self.down1 = nn.Conv2d(4, 4, 3, 2, 1), nn.Conv2d(6, 6, 3, 2, 1)
            self.txt = nn.Linear(width, 6)
            k = 2 if skips else 1
            self.u1, self.u0 = Res(6 * k, 6), Res(6 + (4 if skips else 0), 4)
            self.up1, self.up0 = nn.Conv2d(6, 6, 3, padding=1), nn.Conv2d(6, 6, 3, padding=1)
            self.cout = nn.Conv2d(4, 1, 3, padding=1)

        def forward(self, sample, timestep, encoder_hidden_states):
            f = timestep.float()[:, None] * torch.arange(1, 5, dtype=torch.float32)[None] / 1000
            temb = torch.cat([torch.cos(f), torch.sin(f)], dim=1)
            h0 = self.d0(self.cin(sample), temb)                        # 8x8 skip
            h1 = self.d1(self.down0(h0), temb)                          # 4x4 skip
            m = self.mid(self.down1(h1), temb) + self.txt(encoder_hidden_states.mean(1))[:, :, None, None]
            u = self.up1(torch.nn.functional.interpolate(m, scale_factor=2.0, mode="nearest"))
            u = self.u1(torch.cat([u, h1], dim=1) if skips else u, temb)
            u = self.up0(torch.nn.functional.interpolate(u, scale_factor=2.0, mode="nearest"))
            u = self.u0(torch.cat([u, h0], dim=1) if skips else u, temb)
            return self.cout(u)

    torch.manual_seed(0)
    net = Net().eval()
    args = (torch.randn(2, 1, hw, hw), torch.tensor([999, 500]), torch.randn(2, tokens, width))
    torch.onnx.export(net, args, str(path), input_names=["sample", "timestep", "encoder_hidden_states"],
                      output_names=["out_sample"], opset_version=17, dynamo=False,
                      dynamic_axes={k: {0: "batch"} for k in ("sample", "timestep", "encoder_hidden_states", "out_sample")})
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny_unet(tmp_path_factory.mktemp("unet") / "model.onnx")


def _session(model: ir.Model | onnx.ModelProto) -> ort.InferenceSession:
    proto = model if isinstance(model, onnx.ModelProto) else ir.to_proto(model)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _feeds(n=3, seed=0):
    rng = np.random.default_rng(seed)
    return {"sample": rng.standard_normal((n, 1, 8, 8)).astype(np.float32), "timestep": np.array([999, 400, 3][:n], np.int64),
            "encoder_hidden_states": rng.standard_normal((n, L, D)).astype(np.float32)}


def test_skip_structure_is_read_from_the_graph(tiny):
    skips, why = find_skip_concats(ir.load(tiny).graph)
    assert why == "" and len(skips) == 2  # the [cos, sin] Concat of the timestep embedding is not a skip
    # shallowest first: the 8x8 Concat joins the up path with the first down block's output
    g = ir.load(tiny).graph
    producers = {v.name: n for n in g for v in n.outputs}
    assert producers[skips[0].skips[0]].op_type == "Add" and "d0" in producers[skips[0].skips[0]].name
    assert "d1" in producers[skips[1].skips[0]].name and "up1" in producers[skips[1].deep].name


@pytest.mark.parametrize("depth", [1, 2])
def test_full_and_shallow_graphs_reproduce_the_unet(tiny, depth):
    model = ir.load(tiny)
    base = _session(ir.load(tiny)).run(None, _feeds())[0]
    res = CacheUNetFeaturesPass(depth=depth, interval=3)(model)
    assert res.modified
    outs = [v.name for v in model.graph.outputs]
    rec = json.loads(model.metadata_props[_keys.UNET_CACHE])
    assert outs == ["out_sample", rec["deep_output"]] and rec["depth"] == depth
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    eps, deep = _session(model).run(None, _feeds())
    np.testing.assert_array_equal(eps, base)  # the prediction is untouched
    shallow = shallow_model(model, rec["deep_output"])
    onnx.checker.check_model(ir.to_proto(shallow), full_check=True)
    sess = _session(shallow)
    names = [i.name for i in sess.get_inputs()]
    # the text states only feed the deep part here: the shallow graph does not take them
    assert names == ["sample", "timestep", rec["deep_output"]]
    f = _feeds()
    got = sess.run(None, {"sample": f["sample"], "timestep": f["timestep"], rec["deep_output"]: deep})[0]
    np.testing.assert_allclose(got, base, atol=1e-6)
    macs = node_macs(ir.load(tiny))
    assert 0 < part_cost(macs, shallow) < sum(macs.values())
    # with another step's deep feature the output differs: the shallow graph does read the cache
    other = _session(model).run(None, _feeds(seed=1))[1]
    assert np.abs(sess.run(None, {"sample": f["sample"], "timestep": f["timestep"], rec["deep_output"]: other})[0] - base).max() > 1e-3
    assert not CacheUNetFeaturesPass(depth=depth, interval=3)(model).modified  # second run


def test_no_skip_connection_says_why(tmp_path, caplog):
    model = ir.load(_tiny_unet(tmp_path / "plain.onnx", skips=False))
    with caplog.at_level(logging.WARNING):
        res = CacheUNetFeaturesPass(depth=1, interval=2)(model)
    assert not res.modified and _keys.UNET_CACHE not in model.metadata_props
    msg = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert "cache-unet: nothing to cache" in msg and "ancestors" in msg


def test_bad_options_are_refused(tiny):
    with pytest.raises(PassConfigError, match="depth= and interval="):
        CacheUNetFeaturesPass(depth=1)
    with pytest.raises(PassConfigError, match="refresh_steps"):
        CacheUNetFeaturesPass(depth=1, interval=2, refresh_steps="1/2")
    for bad in ("5:0", "5", "5:2/4:2", "a:b", "5:2:1:1:1"):
        with pytest.raises(PassConfigError, match="schedules="):
            CacheUNetFeaturesPass(depth=1, schedules=bad)
    with pytest.raises(PassConfigError, match="needs depth="):
        CacheUNetFeaturesPass(schedules="5:2")
    with pytest.raises(PassConfigError, match="2 skip connections"):
        CacheUNetFeaturesPass(depth=3, interval=2)(ir.load(tiny))
    m = ir.load(tiny)
    CacheUNetFeaturesPass(depth=1, interval=2)(m)
    with pytest.raises(PassConfigError, match="already ran on this U-Net with other options"):
        CacheUNetFeaturesPass(depth=2, interval=2)(m)
    m.graph.inputs.pop()
    with pytest.raises(ir.passes.PreconditionError, match="diffusion U-Net"):
        CacheUNetFeaturesPass(depth=1, interval=2)(m)


def test_refresh_rule():
    p = from_json(FeatureCacheParams, {"shallow_unet": "s", "deep_output": "d", "deep_input": "d", "depth": 1,
                                       "interval": 3, "warmup": 2}, "fc")
    assert [k for k in range(10) if p.refreshes(k)] == [0, 1, 2, 5, 8]
    assert all(p.refreshes(k, 1) for k in range(10))  # interval 1: caching off
    assert [k for k in range(10) if p.refreshes(k, 4)] == [0, 4, 8]  # a call's uniform interval replaces the rule
    f = from_json(FeatureCacheParams, {"shallow_unet": "s", "deep_output": "d", "deep_input": "d", "depth": 1,
                                       "interval": 4, "final": 3}, "fc")
    assert [k for k in range(10) if f.refreshes(k, None, 10)] == [0, 4, 7, 8, 9]
    q = from_json(FeatureCacheParams, {"shallow_unet": "s", "deep_output": "d", "deep_input": "d", "depth": 1,
                                       "interval": 4, "refresh_steps": [0, 1, 3]}, "fc")
    assert [k for k in range(12) if q.refreshes(k)] == [0, 1, 3, 7, 11]
    assert refresh_count(20, 3, 2) == sum(p.refreshes(k) for k in range(20)) == 8
    assert refresh_count(10, 4, 0, None, 3) == 5
    with pytest.raises(PlanError, match="refresh_steps"):
        from_json(FeatureCacheParams, {"shallow_unet": "s", "deep_output": "d", "deep_input": "d", "depth": 1,
                                       "refresh_steps": [1, 2]}, "fc")


def _cache(tiny, depth=2, interval=3, warmup=0):
    model = ir.load(tiny)
    CacheUNetFeaturesPass(depth=depth, interval=interval, warmup=warmup)(model)
    deep = json.loads(model.metadata_props[_keys.UNET_CACHE])["deep_output"]
    full, shallow, plain = _session(model), _session(shallow_model(model, deep)), _session(ir.load(tiny))
    log = []

    def f(x, t, c):
        log.append("full")
        return tuple(full.run(["out_sample", deep], {"sample": x, "timestep": t, "encoder_hidden_states": c}))

    def s(x, t, c, h):
        log.append("shallow")
        return shallow.run(None, {"sample": x, "timestep": t, deep: h})[0]

    p = FeatureCacheParams("s", deep, deep, depth, interval, warmup)

    def unet(x, t, c):
        return plain.run(None, {"sample": x, "timestep": t, "encoder_hidden_states": c})[0]

    return unet, FeatureCache(f, s, p.refreshes), log, (full, shallow, deep)


def test_denoise_refresh_and_reuse_steps(tiny):
    unet, cache, log, (full, shallow, deep) = _cache(tiny, interval=3, warmup=1)
    rng = np.random.default_rng(0)
    ctx, null, noise = rng.standard_normal((2, L, D)).astype(np.float32), np.zeros((1, L, D), np.float32), \
        rng.standard_normal((2, 1, 8, 8)).astype(np.float32)
    sched = make_scheduler(SCHED)
    plain = Denoiser(unet, sched).sample(ctx, null, noise, 7, 2.0)
    off = Denoiser(unet, sched, cache=cache).sample(ctx, null, noise, 7, 2.0, cache_interval=1)
    np.testing.assert_allclose(off["samples"], plain["samples"], atol=1e-5)
    assert log == ["full"] * 7 and off["shallow_calls"] == 0
    log.clear()
    on = Denoiser(unet, sched, cache=cache).sample(ctx, null, noise, 7, 2.0)
    assert log == ["full", "full", "shallow", "shallow", "full", "shallow", "shallow"] and on["shallow_calls"] == 4
    # the same loop written out: full graph on refresh steps, shallow graph on the cached feature otherwise
    x, h = noise.copy(), None
    for k, t in enumerate(sched.timesteps(7)):
        feeds = {"sample": np.concatenate([x, x]), "timestep": np.full(4, t, np.int64),
                 "encoder_hidden_states": np.concatenate([np.broadcast_to(null, (2, L, D)), ctx]).astype(np.float32)}
        if k in (0, 1, 4):
            e, h = full.run(["out_sample", deep], feeds)
        else:
            e = shallow.run(None, {"sample": feeds["sample"], "timestep": feeds["timestep"], deep: h})[0]
        x, _ = sched.step(e[:2] + np.float32(2.0) * (e[2:] - e[:2]), t, x, 7)
    np.testing.assert_allclose(on["samples"], x, atol=1e-6)
    assert np.abs(on["samples"] - plain["samples"]).max() > 1e-4  # reuse steps do change the result


def test_rows_leaving_the_batch_keep_their_own_cache(tiny):
    unet, cache, _, _ = _cache(tiny, depth=1, interval=2)
    rng = np.random.default_rng(3)
    n = 4
    ctx = rng.standard_normal((n, L, D)).astype(np.float32) * np.array([0.1, 1, 3, 10], np.float32)[:, None, None]
    null, noise = np.zeros((1, L, D), np.float32), rng.standard_normal((n, 1, 8, 8)).astype(np.float32)
    den = Denoiser(unet, make_scheduler(SCHED), cache=cache)
    change = den.sample(ctx, null, noise, 12, 2.0)["change"][2:11]  # [step, row], the stop rule's measure
    for thr in np.quantile(change, np.linspace(0.1, 0.9, 33)):  # a threshold at which the rows stop at different steps
        rule = StopRule(float(thr), 12, 3)
        batch = den.sample(ctx, null, noise, 0, 2.0, stop_rule=rule)
        if len(set(batch["steps"].tolist())) > 1:
            break
    assert len(set(batch["steps"].tolist())) > 1  # rows did leave the batch at different steps
    for i in range(n):
        one = den.sample(ctx[i:i + 1], null, noise[i:i + 1], 0, 2.0, stop_rule=rule)
        assert one["steps"][0] == batch["steps"][i]
        np.testing.assert_allclose(one["samples"][0], batch["samples"][i], atol=1e-5)


def test_plan_refuses_a_feature_cache_the_unet_lacks():
    from dyncompile.runtime.diffusion.steps import DiffusionDenoiseStep

    class _Sess:
        def get_inputs(self):
            return [types.SimpleNamespace(name=n) for n in ("sample", "timestep", "encoder_hidden_states")]

        def get_outputs(self):
            return [types.SimpleNamespace(name="out_sample")]

    params = {"unet": "unet", "scheduler": SCHED, "sample_shape": [1, 4, 4], "guidance_scale": 2.0, "num_inference_steps": 3,
              "feature_cache": {"shallow_unet": "s", "deep_output": "deep", "deep_input": "deep", "depth": 1, "interval": 2}}
    ctx = types.SimpleNamespace(session=lambda key: _Sess(), plan=None)
    with pytest.raises(PlanError, match="deep_output 'deep' is not an output"):
        DiffusionDenoiseStep(Step("diffusion_denoise", params), ctx)


# ------------------------------------------------------------------------------------------ the real pipeline


@pytest.fixture(scope="module")
def plans(module_tmp):
    from dyncompile.models import build_model

    pipe = build_model("fashion-diffusion", progress=False).dir
    out = module_tmp("fdcache")
    dyncompile.compile(pipe, "verify,cleanup", out / "plain", progress=False)
    dyncompile.compile(pipe, "verify,cleanup,cache-unet{depth=2,interval=3}", out / "cached", progress=False)
    dyncompile.compile(pipe, "verify,cleanup,cache-unet{depth=2,schedules=5:1/6:3:0:1}", out / "table", progress=False)
    return out


def test_asset_plan_caching_off_equals_the_uncached_plan(plans):
    plain = dyncompile.load(plans / "plain", provider="cpu")
    cached = dyncompile.load(plans / "cached", provider="cpu")
    p = json.loads((plans / "cached" / "plan.json").read_text())
    fc = p["steps"][-1]["feature_cache"]
    assert fc["depth"] == 2 and fc["deep_output"] == "/up_samplers.1/Conv_output_0" and "unet_shallow" in p["files"]
    prompts = ["a dark patterned pullover", "an image of a bag"]
    a = plain.generate_images(prompts, steps=6, seed=0)
    off = cached.generate_images(prompts, steps=6, seed=0, cache_interval=1)
    assert np.abs(off.samples - a.samples).max() <= 1e-5 and off.shallow_calls == 0
    on = cached.generate_images(prompts, steps=6, seed=0)
    assert on.unet_calls == 6 and on.shallow_calls == 4  # refresh at steps 0 and 3
    from dyncompile.passes.step_saver.metrics import ssim

    s = ssim(on.images, a.images)
    assert 0.5 < s.min() and (on.images != a.images).any()


def test_asset_plan_with_a_table_by_step_count(plans):
    """An explicit table: 5-step schedules uncached (the uncached plan's outputs), 6 and more: interval 3, final 1."""
    plain = dyncompile.load(plans / "plain", provider="cpu")
    table = dyncompile.load(plans / "table", provider="cpu")
    fc = json.loads((plans / "table" / "plan.json").read_text())["steps"][-1]["feature_cache"]
    assert [(r["steps"], r["interval"], r["final"]) for r in fc["schedules"]] == [(5, 1, 0), (6, 3, 1)]
    assert (fc["interval"], fc["final"]) == (3, 1)  # the plan's own rule: the last row's
    prompts = ["a dark patterned pullover", "an image of a bag"]
    for k in (4, 5):
        off = table.generate_images(prompts, steps=k, seed=0)
        assert off.shallow_calls == 0 and np.abs(off.samples - plain.generate_images(prompts, steps=k, seed=0).samples).max() <= 1e-5
    assert table.generate_images(prompts, steps=6, seed=0).shallow_calls == 3  # refresh at 0, 3 and the final step 5
    assert table.generate_images(prompts, steps=9, seed=0).shallow_calls == 5  # 0, 3, 6, 8


def test_asset_plan_with_a_tampered_schedule_is_refused(plans, tmp_path):
    import shutil

    dst = tmp_path / "bad"
    shutil.copytree(plans / "cached", dst)
    p = json.loads((dst / "plan.json").read_text())
    p["steps"][-1]["feature_cache"]["refresh_steps"] = [2, 1]
    (dst / "plan.json").write_text(json.dumps(p))
    with pytest.raises(PlanError, match="refresh_steps"):
        dyncompile.load(dst, provider="cpu")


def test_cli_cache_interval(plans, tmp_path, capsys):
    from dyncompile.tools.cli import main

    def run(*extra):
        out = tmp_path / f"o{len(extra)}.png"
        rc = main(["run", str(plans / "cached"), "--prompt", "an image of a bag", "--steps", "4", "--json", "-o", str(out),
                   *extra])
        cap = capsys.readouterr()
        assert rc == 0, cap.err
        return json.loads(cap.out)

    assert run()["shallow_calls"] == 2  # interval 3 over 4 steps: refresh at steps 0 and 3
    assert run("--cache-interval", "1")["shallow_calls"] == 0
    rc = main(["run", str(plans / "plain"), "--prompt", "a bag", "--cache-interval", "2", "-o", str(tmp_path / "x.png")])
    assert rc == 2 and "compile it with --passes cache-unet" in capsys.readouterr().err


def test_passes_after_cache_unet_apply_to_the_shallow_graph_too(module_tmp):
    from dyncompile.models import build_model

    pipe = build_model("fashion-diffusion", progress=False).dir
    out = module_tmp("fdq") / "q"
    dyncompile.compile(pipe, "verify,cleanup,cache-unet{depth=3,interval=2},quantize-int8", out, progress=False)
    shallow = onnx.load(str(out / "unet" / "shallow.onnx"))
    ops = {n.op_type for n in shallow.graph.node}
    assert "MatMulInteger" in ops or "DynamicQuantizeLinear" in ops  # the 16x16 transformer's MatMuls, quantized
    assert "encoder_hidden_states" in [i.name for i in shallow.graph.input]  # depth 3 reaches the cross-attention


def test_calibration_picks_the_cheapest_schedule_within_budget_and_records_it(tmp_path, module_tmp, monkeypatch):
    """The tiny U-Net in a copy of the asset's pipeline folder (its text encoder, 12 x 384 text states)."""
    import shutil

    from dyncompile.models import build_model

    src = build_model("fashion-diffusion", progress=False).dir
    pipe = tmp_path / "pipe"
    shutil.copytree(src, pipe, ignore=shutil.ignore_patterns("unet"))
    (pipe / "unet").mkdir()
    _tiny_unet(pipe / "unet" / "model.onnx", hw=32, tokens=12, width=384)
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                             ["a bag", "a dark coat", "plain sandal", "a shirt", "trousers", "a light dress",
                              "patterned pullover", "an ankle boot"]))
    kw = dict(calib=str(calib), steps=4, reference_steps=8, max_depth=2, intervals="2/3", limit=8)
    model = ir.load(pipe / "unet" / "model.onnx")
    assert CacheUNetFeaturesPass(str(pipe), max_ssim_drop=0.999, **kw)(model).modified
    rec = json.loads(model.metadata_props[_keys.UNET_CACHE])
    cal = rec["calibration"]
    tried = cal["tried"]
    # a budget everything meets: the first (cheapest) candidate wins, and its measured quality is in the record
    assert len(tried) == 1 and cal["chosen_mean_ssim"] == tried[0]["mean_ssim"]
    assert (rec["depth"], rec["interval"], rec["warmup"], rec["final"]) == tuple(tried[0][k] for k in ("depth", "interval", "warmup", "final"))
    assert cal["prompts"] == 8 and cal["steps"] == 4 and cal["reference_steps"] == 8
    strict = ir.load(pipe / "unet" / "model.onnx")
    CacheUNetFeaturesPass(str(pipe), max_ssim_drop=1e-9, **kw)(strict)
    c2 = json.loads(strict.metadata_props[_keys.UNET_CACHE])["calibration"]
    costs = [t["est_cost"] for t in c2["tried"]]
    assert costs == sorted(costs) and c2["ssim_drop"] <= 1e-9  # cheapest first; the winner meets the budget
    from dyncompile.passes.unet_cache.cache_unet_pass import _Runner

    plain_sample = _Runner.sample

    def worse(self, depth, *a):  # every cached candidate drifts from the uncached loop
        out = plain_sample(self, depth, *a)
        return out if depth is None else np.random.default_rng(0).uniform(-1, 1, out.shape).astype(np.float32)

    monkeypatch.setattr(_Runner, "sample", worse)
    with pytest.raises(PassConfigError, match="no candidate keeps mean SSIM within"):
        CacheUNetFeaturesPass(str(pipe), max_ssim_drop=1e-9, **kw)(ir.load(pipe / "unet" / "model.onnx"))
    monkeypatch.undo()
    out = module_tmp("fdcal") / "plan"
    dyncompile.compile(pipe, "cache-unet{steps=4,reference_steps=8,max_depth=2,intervals=2/3,limit=8,max_ssim_drop=0.999}",
                       out, calib=str(calib), progress=False)
    fc = json.loads((out / "plan.json").read_text())["steps"][-1]["feature_cache"]
    assert fc["calibration"]["tried"] == tried and fc["depth"] == rec["depth"]
    # the calibration measures what the bench measures: the plan's images with the same prompts and seeds (torch
    # noise, the asset's seeds), SSIM to the plan's 8-step image, cached against caching off at the same steps
    from dyncompile.passes.step_saver.metrics import ssim

    plan = dyncompile.load(out, provider="cpu")
    prompts = [json.loads(line)["prompt"] for line in calib.read_text().splitlines()]
    seeds = [1_000_000 + i for i in range(len(prompts))]
    gen = dict(seed=seeds, noise_source="torch")
    ref = plan.generate_images(prompts, steps=8, cache_interval=1, **gen).images
    off = plan.generate_images(prompts, steps=4, cache_interval=1, **gen).images
    on = plan.generate_images(prompts, steps=4, **gen).images
    assert abs(float(ssim(off, ref).mean()) - fc["calibration"]["uncached_mean_ssim"]) <= 1e-5
    assert abs(float(ssim(on, ref).mean()) - fc["calibration"]["chosen_mean_ssim"]) <= 1e-5
    assert fc["calibration"]["noise"] == "torch"
    img = plan.generate_images(["a bag"], steps=4)
    assert img.shallow_calls == 4 - sum(
        FeatureCacheParams("s", "d", "d", fc["depth"], fc["interval"], fc["warmup"], fc["final"]).refreshes(k, None, 4)
        for k in range(4))


# ------------------------------------------------------------------ a calibrated rule per step count (table)

_FC = {"shallow_unet": "s", "deep_output": "d", "deep_input": "d", "depth": 1, "interval": 2}


def test_schedule_table_picks_the_row_of_the_step_count():
    p = from_json(FeatureCacheParams, _FC | {"schedules": [
        {"steps": 4, "interval": 1}, {"steps": 8, "interval": 2, "final": 2}, {"steps": 12, "interval": 3, "warmup": 1}]}, "fc")
    on = {K: [k for k in range(K) if p.refreshes(k, None, K)] for K in (3, 4, 7, 8, 10, 12, 14)}
    assert on[3] == [0, 1, 2] and on[4] == [0, 1, 2, 3] and on[7] == list(range(7))  # below the first row, and "off"
    assert on[8] == [0, 2, 4, 6, 7] and on[10] == [0, 2, 4, 6, 8, 9]  # the 8-step row, up to the next row
    assert on[12] == [0, 1, 4, 7, 10] and on[14] == [0, 1, 4, 7, 10, 13]
    assert p.schedule_for(11).steps == 8 and p.schedule_for(3) is None
    assert [k for k in range(8) if p.refreshes(k, 4, 8)] == [0, 4]  # a call's uniform interval still wins
    assert [k for k in range(6) if p.refreshes(k)] == [0, 2, 4]  # no step count known: the plan's own rule
    for bad, msg in (([{"steps": 8}, {"steps": 4}], "increasing 'steps'"), ([{"steps": 4}, {"steps": 4}], "increasing"),
                     ([], "non-empty"), ([{"steps": 4, "refresh_steps": [1]}], r"schedules\[0\].refresh_steps"),
                     ([{"steps": 0}], r"schedules\[0\].steps must be"), ([{"steps": 4, "cost": 1}], "unknown field 'cost'")):
        with pytest.raises(PlanError, match=msg):
            from_json(FeatureCacheParams, _FC | {"schedules": bad}, "fc")


def test_denoise_step_runs_each_prompt_with_the_row_of_its_predicted_step_count(tiny):
    """The runtime's ``diffusion_denoise`` on StepSaver's per-prompt counts: rows 3 and 6 of the table each run the
    rule of their own step count (3: caching off, 6: interval 2), as the loop written out for each prompt alone."""
    from dyncompile.runtime.diffusion.steps import DiffusionDenoiseStep

    model = ir.load(tiny)
    CacheUNetFeaturesPass(depth=2, interval=3)(model)
    deep = json.loads(model.metadata_props[_keys.UNET_CACHE])["deep_output"]
    sessions = {"unet": _session(model), "s": _session(shallow_model(model, deep)), "plain": _session(ir.load(tiny))}
    params = {"unet": "unet", "scheduler": SCHED, "sample_shape": [1, 8, 8], "guidance_scale": 2.0, "num_inference_steps": 3,
              "feature_cache": _FC | {"deep_output": deep, "deep_input": deep, "depth": 2, "schedules": [
                  {"steps": 3, "interval": 1}, {"steps": 6, "interval": 2}]}}
    step = DiffusionDenoiseStep(Step("diffusion_denoise", params), types.SimpleNamespace(session=sessions.get, plan=None))
    rng = np.random.default_rng(5)
    n = 3
    ctx, null = rng.standard_normal((n, L, D)).astype(np.float32), np.zeros((1, L, D), np.float32)
    noise = rng.standard_normal((n, 1, 8, 8)).astype(np.float32)
    want = np.array([3, 6, 6])
    st = step.run({"ctx": ctx, "null_ctx": null, "noise": noise, "predicted_steps": want, "step_policy": "predicted"})
    assert st["steps"].tolist() == want.tolist()
    assert st["shallow_calls"] == 3 and st["unet_calls"] == 3 + 6  # 6 steps, interval 2: steps 1, 3, 5 reuse
    sched = make_scheduler(SCHED)

    def alone(i, k, reuse):
        x, h = noise[i:i + 1].copy(), None
        for j, t in enumerate(sched.timesteps(k)):
            feeds = {"sample": np.concatenate([x, x]), "timestep": np.full(2, t, np.int64),
                     "encoder_hidden_states": np.concatenate([null, ctx[i:i + 1]])}
            if j in reuse:
                e = sessions["s"].run(None, {"sample": feeds["sample"], "timestep": feeds["timestep"], deep: h})[0]
            else:
                e, h = sessions["unet"].run(["out_sample", deep], feeds)
            x, _ = sched.step(e[:1] + np.float32(2.0) * (e[1:] - e[:1]), t, x, k)
        return x[0]

    np.testing.assert_allclose(st["samples"][0], alone(0, 3, ()), atol=1e-5)
    for i in (1, 2):
        np.testing.assert_allclose(st["samples"][i], alone(i, 6, (1, 3, 5)), atol=1e-5)
    # the 3-step row is "no caching": the plain U-Net's loop
    plain = Denoiser(lambda x, t, c: sessions["plain"].run(None, {"sample": x, "timestep": t, "encoder_hidden_states": c})[0],
                     sched).sample(ctx[:1], null, noise[:1], 3, 2.0)
    np.testing.assert_allclose(st["samples"][0], plain["samples"][0], atol=1e-5)


def test_calibrated_table_by_step_count(tmp_path, module_tmp, monkeypatch):
    """``steps=2/4`` on the tiny U-Net in a copy of the asset's pipeline folder: one cheapest rule per step count
    within the budget at that count ("no caching" where none is), recorded with its measured quality, which is the
    quality of the compiled plan's own images at that step count."""
    import shutil

    from dyncompile.models import build_model
    from dyncompile.passes.step_saver.metrics import ssim
    from dyncompile.passes.unet_cache.cache_unet_pass import _Runner

    src = build_model("fashion-diffusion", progress=False).dir
    pipe = tmp_path / "pipe"
    shutil.copytree(src, pipe, ignore=shutil.ignore_patterns("unet"))
    (pipe / "unet").mkdir()
    _tiny_unet(pipe / "unet" / "model.onnx", hw=32, tokens=12, width=384)
    prompts = ["a bag", "a dark coat", "plain sandal", "a shirt", "trousers", "a light dress", "patterned pullover",
               "an ankle boot"]
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    kw = dict(calib=str(calib), steps="3/6", reference_steps=8, max_depth=2, intervals="2/3", limit=8,
              reference=str(tmp_path / "ref.npz"))
    with pytest.raises(PassConfigError, match="steps=grid .* run step-saver before cache-unet"):
        CacheUNetFeaturesPass(str(pipe), **(kw | {"steps": "grid"}))(ir.load(pipe / "unet" / "model.onnx"))
    with pytest.raises(PassConfigError, match="a table by step count"):
        CacheUNetFeaturesPass(str(pipe), depth=1, interval=2, calib=str(calib), steps="3/6")
    model = ir.load(pipe / "unet" / "model.onnx")
    assert CacheUNetFeaturesPass(str(pipe), max_ssim_drop=0.999, **kw)(model).modified
    rec = json.loads(model.metadata_props[_keys.UNET_CACHE])
    t = rec["schedules"]
    assert [r["steps"] for r in t] == [3, 6] and rec["calibration"]["by_steps"] and rec["calibration"]["steps"] == [3, 6]
    assert set(rec["calibration"]["depths_tried"]) == {"1", "2"}
    for r in t:  # a budget everything meets: the first (cheapest) candidate at that step count wins
        q = r["quality"]
        assert len(q["tried"]) == 1 and (r["interval"], r["warmup"], r["final"]) == tuple(
            q["tried"][0][k] for k in ("interval", "warmup", "final")) and q["tried"][0]["depth"] == rec["depth"]
    assert (rec["interval"], rec["warmup"], rec["final"]) == (t[-1]["interval"], t[-1]["warmup"], t[-1]["final"])
    # a budget nothing meets: every row is "no caching" (a table is not an error, unlike a single steps=)
    plain_sample = _Runner.sample

    def worse(self, depth, sched, ctx, null, noise, steps, scale):
        assert steps != 8, "the 8-step reference images come from reference="
        out = plain_sample(self, depth, sched, ctx, null, noise, steps, scale)
        return out if depth is None else np.random.default_rng(0).uniform(-1, 1, out.shape).astype(np.float32)

    key = str(np.load(tmp_path / "ref.npz")["key"])
    monkeypatch.setattr(_Runner, "sample", worse)
    m2 = ir.load(pipe / "unet" / "model.onnx")
    CacheUNetFeaturesPass(str(pipe), max_ssim_drop=1e-9, depth=1, **kw)(m2)
    t2 = json.loads(m2.metadata_props[_keys.UNET_CACHE])["schedules"]
    assert [(r["interval"], r["quality"]["ssim_drop"], r["quality"]["est_cost_per_step"]) for r in t2] == [(1, 0.0, 1.0)] * 2
    assert all(len(r["quality"]["tried"]) > 1 for r in t2)
    monkeypatch.undo()
    # another reference (9 steps): the file's images do not apply; computed again, and the file replaced
    CacheUNetFeaturesPass(str(pipe), max_ssim_drop=0.999, depth=1, **(kw | {"reference_steps": 9}))(
        ir.load(pipe / "unet" / "model.onnx"))
    with np.load(tmp_path / "ref.npz") as f:
        assert str(f["key"]) != key and len(f["images"]) == 8

    def worse_at_3(self, depth, sched, ctx, null, noise, steps, scale):  # caching spoils 3-step images only
        out = plain_sample(self, depth, sched, ctx, null, noise, steps, scale)
        return out if depth is None or steps != 3 else np.random.default_rng(0).uniform(-1, 1, out.shape).astype(np.float32)

    # the compiled plan: a row without caching (3 steps) and a row with (6), each measured as the plan runs it
    monkeypatch.setattr(_Runner, "sample", worse_at_3)
    out = module_tmp("fdtable") / "plan"
    dyncompile.compile(pipe, "cache-unet{steps=3/6,reference_steps=8,depth=1,intervals=2/3,limit=8,max_ssim_drop=0.02}",
                       out, calib=str(calib), progress=False)
    monkeypatch.undo()
    fc = json.loads((out / "plan.json").read_text())["steps"][-1]["feature_cache"]
    plan = dyncompile.load(out, provider="cpu")
    gen = dict(seed=[1_000_000 + i for i in range(len(prompts))], noise_source="torch")
    ref = plan.generate_images(prompts, steps=8, cache_interval=1, **gen).images
    for r in fc["schedules"]:
        k, q = r["steps"], r["quality"]
        off = plan.generate_images(prompts, steps=k, cache_interval=1, **gen)
        on = plan.generate_images(prompts, steps=k, **gen)
        assert abs(float(ssim(off.images, ref).mean()) - q["uncached_mean_ssim"]) <= 1e-5
        assert abs(float(ssim(on.images, ref).mean()) - q["mean_ssim"]) <= 1e-5
        rule = FeatureCacheParams("s", "d", "d", 1, r["interval"], r["warmup"], r["final"])
        assert on.shallow_calls == k - sum(rule.refreshes(j, None, k) for j in range(k))
        if r["interval"] == 1:  # "no caching": the uncached plan's outputs
            assert on.shallow_calls == 0 and np.abs(on.samples - off.samples).max() <= 1e-5
    assert [r["interval"] == 1 for r in fc["schedules"]] == [True, False]
