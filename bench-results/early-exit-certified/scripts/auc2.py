import sys, numpy as np
from dyncompile.passes.early_exit.certify import _fit_logistic, _auc
from dyncompile.runtime.exit_policy import policy_features
name=sys.argv[1]; z=np.load(f"/tmp/cert-work/{name}-probs.npz")
P0,ct0=z["P"],z["ct"]
# never on movie-test: fit on the first 1,000 movie-calib rows (OOF head probs), evaluate on the other 1,000
P,TP,ct,tt=P0[:,:1000],P0[:,1000:],ct0[:1000],ct0[1000:]
def feats(PP,e):
    base=policy_features(PP[e], PP[e-1] if e>0 else None)
    avg=PP[:e+1].mean(0); lp=np.log(np.clip(PP[:e+1],1e-30,1)).sum(0)
    streak=np.zeros(PP.shape[1])
    for j in range(e,-1,-1):
        ok=(PP[j].argmax(1)==PP[e].argmax(1)); 
        if j<e: streak+= ok*(streak==(e-j-1))
    lpm=lp.max(1)-np.sort(lp,1)[:,-2]
    ex=np.c_[base, avg.max(1), (avg.argmax(1)==PP[e].argmax(1)), streak, lpm, np.log(np.clip(PP[e],1e-30,1)).max(1)-np.log(np.clip(PP[e],1e-30,1)).min(1)]
    return base, ex
ref=ct.argmax(1); tref=tt.argmax(1)
for e in range(P.shape[0]-1):
    t=(P[e].argmax(1)==ref).astype(float); tt_=(TP[e].argmax(1)==tref).astype(float)
    out=[]
    for k in (0,1):
        x=feats(P,e)[k]; xt=feats(TP,e)[k]
        mu,sd=x.mean(0),x.std(0); sd=np.where(sd>1e-9,sd,np.inf)
        w=_fit_logistic(np.c_[(x-mu)/sd,np.ones(len(x))],t,1.0)
        out.append(_auc(np.c_[(xt-mu)/sd,np.ones(len(xt))]@w, tt_))
    print(e, out)
