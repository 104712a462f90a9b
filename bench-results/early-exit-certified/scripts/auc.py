import sys, numpy as np
from dyncompile.passes.early_exit.certify import fit_exit_policy, _auc
from dyncompile.passes.early_exit.exit_heads import exit_scores
name=sys.argv[1]; z=np.load(f"/tmp/cert-work/{name}-probs.npz")
P0,ct0=z["P"],z["ct"]
# never on movie-test: fit on the first 1,000 movie-calib rows (OOF head probs), evaluate on the other 1,000
P,TP,ct,tt=P0[:,:1000],P0[:,1000:],ct0[:1000],ct0[1000:]
pol=fit_exit_policy(P[:, :600], ct[:600].argmax(1))
pol2=fit_exit_policy(P, ct.argmax(1))
se=exit_scores(TP,"entropy"); sl=pol.scores(TP); sl2=pol2.scores(TP)
ref=tt.argmax(1)
for e in range(TP.shape[0]-1):
    t=(TP[e].argmax(1)==ref).astype(float)
    print(e, "agree %.3f"%t.mean(), "AUC entropy", _auc(se[e],t), "learned(600)", _auc(sl[e],t), "learned(1000)", _auc(sl2[e],t))
print(pol2.weights)
