import sys, time, numpy as np, logging
from dyncompile.passes.early_exit.exit_heads import fit_exit_heads
from dyncompile.passes.early_exit.certify import certify_exits, _first_exit, CertificationError
from dyncompile.runtime.exit_policy import ExitPolicy
from dyncompile.passes.early_exit.exit_heads import exit_scores
name = sys.argv[1]
d = np.load(f"/tmp/cert-work/{name}.npz")
L = int(d["L"]); exits = list(d["exits"]); E = len(exits)
cf = [d[f"calib_f{j}"] for j in range(E)]; tf = [d[f"test_f{j}"] for j in range(E)]
ct, tt, cy, ty = d["calib_teacher"], d["test_teacher"], d["calib_y"], d["test_y"]
t0 = time.time()
import os
if os.path.exists(f"/tmp/cert-work/{name}-probs.npz"):
    z=np.load(f"/tmp/cert-work/{name}-probs.npz"); P,TP=z["P"],z["TP"]
else:
  fit = fit_exit_heads(cf, ct.astype(np.float32), cy, pooling="cls+mean")
  print("fit", time.time() - t0)
  P = np.concatenate([fit.oof_probs, ct[None].astype(np.float32)])
  TP = np.stack([h.predict_proba(f) for h, f in zip(fit.heads, tf)] + [tt.astype(np.float32)])
  np.savez(f"/tmp/cert-work/{name}-probs.npz", P=P, TP=TP, cy=cy, ty=ty, ct=ct, tt=tt)
costs = [k / L for k in exits] + [1.0]
full_acc = (tt.argmax(1) == ty).mean() * 100
print("full test acc", full_acc)
def evaluate(res):
    if res.criterion == "learned":
        s = res.policy.scores(TP)
        tc = np.array([np.inf if t is None else t for t in res.thresholds])
    else:
        s = exit_scores(TP, res.criterion)
        tc = np.array([np.inf if t is None else (-t if res.criterion == "entropy" else t) for t in res.thresholds])
    ex = _first_exit(s, tc)
    pred = TP[ex, np.arange(len(ty))].argmax(1)
    layers = np.array(exits + [L])[ex]
    return (pred == ty).mean() * 100 - full_acc, L / layers.mean(), (pred == tt.argmax(1)).mean() * 100
for crit in ["entropy", "learned"]:
    for conf in [0.9, None]:
        for budget in [1.0, 2.0]:
            for split in [0.3]:
                t0 = time.time()
                try:
                    r = certify_exits(P, ct, cy, costs, budget=budget, confidence=conf, criterion=crit, split=split)
                except CertificationError as e:
                    print(crit, conf, budget, "ERR", e); continue
                drop, sp, agr = evaluate(r)
                c = r.certificate
                print(f"{crit:8s} conf={conf} b={budget} split={split}: calib obs {c.observed:.2f} bound {c.bound} sp_calib {c.expected_speedup:.2f} | test drop {drop:+.2f} layer-speedup {sp:.2f} agree {agr:.1f} ({time.time()-t0:.1f}s) path {c.path_length} pt {c.point}")
