# Model of the dK/dV kernel's (producer, consumer) step order with the counter form and the GQA skip:
# every consumer must compute exactly the (head, Q tile) pairs in which some query row sees one of its keys
# (plus possibly fully-masked ones), and consume the producer's sequence in order.
import itertools
def cdiv(a,b): return -(-a//b)
ROWS=64
def check(NQ,NK,BM,CONS,GROUP):
    off=NK-NQ
    n_kv=cdiv(NK,ROWS*CONS)
    for r in range(n_kv):
        n0=r*ROWS*CONS
        i_start=max(n0-off,0)//BM
        n_tiles=max(cdiv(NQ,BM)-i_start,0)
        prod=[(g,i_start+t) for t in range(n_tiles) for g in range(GROUP)]  # producer: tile-major
        for wg in range(CONS):
            row0=n0+wg*ROWS
            n_iters=GROUP*n_tiles; c=0; ist=i_start
            skip=0
            if wg>0:
                skip=min(max(row0-off,0)//BM-ist, n_tiles)*GROUP
                assert skip>=0
                c+=skip; ist+=skip//GROUP; n_iters-=skip
            i=ist; g=0; computed=[]
            for it in range(n_iters):
                assert prod[c+it]==(g,i),(prod[c+it],(g,i))
                computed.append((g,i))
                gn=g+1; inx=i+(gn==GROUP); gn=0 if gn==GROUP else gn
                i,g=inx,gn
            skipped=prod[:skip]
            assert prod[:skip]+computed==prod
            # every skipped pair sees none of this wg's keys; every pair with a visible key is computed
            keys=range(row0,min(row0+ROWS,NK))
            for (gg,ii) in prod:
                vis=any(k<=q+off for q in range(ii*BM,min((ii+1)*BM,NQ)) for k in keys)
                if vis: assert (gg,ii) in computed
            for (gg,ii) in skipped:
                assert not any(k<=q+off for q in range(ii*BM,min((ii+1)*BM,NQ)) for k in keys)
n=0
for NQ,NK in [(512,512),(1000,1537),(1,5),(257,257),(300,1000),(1000,300),(129,64),(64,200)]:
    for BM in (64,128):
        for CONS in (1,2,3):
            for GROUP in (1,2,4):
                check(NQ,NK,BM,CONS,GROUP); n+=1
print("ok",n)
