import sys, numpy as np
from dyncompile.passes.early_exit.certify import certify_exits, CertificationError
SPLITS=[float(x) for x in (sys.argv[2] if len(sys.argv)>2 else "0.15,0.2,0.3,0.5").split(",")]
name=sys.argv[1]; z=np.load(f"/tmp/cert-work/{name}-probs.npz"); d=np.load(f"/tmp/cert-work/{name}.npz")
P,ct,cy=z["P"],z["ct"],z["cy"]; L=int(d["L"]); exits=list(d["exits"]); costs=[k/L for k in exits]+[1.0]
for crit in ["entropy","learned"]:
  for split in SPLITS:
    sp=[]
    for seed in range(20):
        try: r=certify_exits(P,ct,cy,costs,budget=1.0,confidence=0.9,criterion=crit,split=split,seed=seed); sp.append(r.certificate.expected_speedup)
        except CertificationError: sp.append(1.0)
    print(crit, split, "mean certified calib-speedup (on the test part)", round(np.mean(sp),3), "min", round(min(sp),3))
