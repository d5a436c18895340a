import glob
for f in sorted(glob.glob('docs/benchmarks/2026-11-29-zen3-fp32/one_row_hits/ab_*.log')):
    rows=[l.split() for l in open(f)]
    rows=[(float(t),int(p),int(d),float(ms)) for t,p,d,ms in rows]
    # split bursts at the largest gap
    gaps=[(rows[i+1][0]-rows[i][0],i) for i in range(len(rows)-1)]
    g,i=max(gaps)
    for name,part in (("cold",rows[:i+1]),("warm",rows[i+1:])):
        tot=sum(r[3] for r in part)/1000
        dec=[r for r in part if r[1]==0]; small=[r for r in part if 0<r[1]<=8]; big=[r for r in part if r[1]>8]
        span=part[-1][0]-part[0][0]
        print(f"{f.split('/')[-1]:12s} {name} steps {len(part)} fwd {tot:6.1f}s span {span:6.1f} | decode-only {len(dec)} {sum(r[3] for r in dec)/1000:5.1f}s | small-p {len(small)} {sum(r[3] for r in small)/1000:5.1f}s | big-p {len(big)} {sum(r[3] for r in big)/1000:6.1f}s rows {sum(r[1] for r in big)}")
