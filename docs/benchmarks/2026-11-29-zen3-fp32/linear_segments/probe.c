#include <immintrin.h>
#include <stdint.h>
#include <omp.h>
#define TGT __attribute__((target("avx2,fma")))
TGT static inline float hsum256(__m256 v){__m128 a=_mm_add_ps(_mm256_castps256_ps128(v),_mm256_extractf128_ps(v,1));a=_mm_hadd_ps(a,a);a=_mm_hadd_ps(a,a);return _mm_cvtss_f32(a);}
#ifndef PFD
#define PFD 1024
#endif
/* variant: 0 current, 1 plain sum, 2 two chains, 3 no prefetch, 4 prefetch every line 2 ahead lines NTA, 5 chunked schedule */
TGT static void tile(const float *x,int64_t K,const float*W,int64_t N,float*y,int64_t n0,int v){
  __m256 acc[4], acc2[4]; const float*w[4]; int64_t nr=N-n0<4?N-n0:4;
  for(int r=0;r<4;r++){w[r]=W+(n0+(r<nr?r:nr-1))*K;acc[r]=_mm256_setzero_ps();acc2[r]=_mm256_setzero_ps();}
  if(v==1){ for(int r=0;r<4;r++){ for(int64_t k=0;k<K;k+=16){acc[r]=_mm256_add_ps(acc[r],_mm256_loadu_ps(w[r]+k));acc2[r]=_mm256_add_ps(acc2[r],_mm256_loadu_ps(w[r]+k+8));}}}
  else if(v==2){ for(int r=0;r<4;r++) for(int64_t k=0;k<K;k+=16){ if((k&8)==0)_mm_prefetch((const char*)(w[r]+k+PFD),_MM_HINT_T0);
        acc[r]=_mm256_fmadd_ps(_mm256_loadu_ps(w[r]+k),_mm256_loadu_ps(x+k),acc[r]); acc2[r]=_mm256_fmadd_ps(_mm256_loadu_ps(w[r]+k+8),_mm256_loadu_ps(x+k+8),acc2[r]);}
      for(int r=0;r<4;r++)acc[r]=_mm256_add_ps(acc[r],acc2[r]);}
  else if(v==3){ for(int r=0;r<4;r++) for(int64_t k=0;k<K;k+=8) acc[r]=_mm256_fmadd_ps(_mm256_loadu_ps(w[r]+k),_mm256_loadu_ps(x+k),acc[r]);}
  else if(v==4){ for(int r=0;r<4;r++) for(int64_t k=0;k<K;k+=8){ if((k&8)==0)_mm_prefetch((const char*)(w[r]+k+PFD),_MM_HINT_NTA);
        acc[r]=_mm256_fmadd_ps(_mm256_loadu_ps(w[r]+k),_mm256_loadu_ps(x+k),acc[r]);}}
  else { for(int r=0;r<4;r++) for(int64_t k=0;k<K;k+=8){ if((k&8)==0)_mm_prefetch((const char*)(w[r]+k+PFD),_MM_HINT_T0);
        acc[r]=_mm256_fmadd_ps(_mm256_loadu_ps(w[r]+k),_mm256_loadu_ps(x+k),acc[r]);}}
  for(int r=0;r<nr;r++) y[n0+r]=hsum256(acc[r]);
}
/* all calls in one parallel region; Ws[i] weight i [Ns[i], Ks[i]], xs[i] input, ys[i] output */
TGT void run_all(int64_t ncalls,const float**Ws,const int64_t*Ns,const int64_t*Ks,const float**xs,float**ys,int v,int nth,int regions){
  if(regions){ for(int64_t i=0;i<ncalls;i++){
#pragma omp parallel for num_threads(nth) schedule(static)
      for(int64_t n0=0;n0<Ns[i];n0+=4) tile(xs[i],Ks[i],Ws[i],Ns[i],ys[i],n0,v);} return; }
#pragma omp parallel num_threads(nth)
  for(int64_t i=0;i<ncalls;i++){
    if(v==5){
#pragma omp for schedule(static,8)
      for(int64_t n0=0;n0<Ns[i];n0+=4) tile(xs[i],Ks[i],Ws[i],Ns[i],ys[i],n0,0);
    } else {
#pragma omp for schedule(static)
      for(int64_t n0=0;n0<Ns[i];n0+=4) tile(xs[i],Ks[i],Ws[i],Ns[i],ys[i],n0,v);
    }
  }
}
/* plain sum over one buffer of n floats, halves per thread */
TGT float sum_flat(const float*p,int64_t n,int nth){ float out[64];
#pragma omp parallel num_threads(nth)
 { int t=omp_get_thread_num(), T=omp_get_num_threads(); int64_t a=n*t/T/64*64, b=(t+1==T)?n:n*(t+1)/T/64*64;
   __m256 s0=_mm256_setzero_ps(),s1=s0,s2=s0,s3=s0;
   for(int64_t i=a;i<b;i+=32){s0=_mm256_add_ps(s0,_mm256_loadu_ps(p+i));s1=_mm256_add_ps(s1,_mm256_loadu_ps(p+i+8));s2=_mm256_add_ps(s2,_mm256_loadu_ps(p+i+16));s3=_mm256_add_ps(s3,_mm256_loadu_ps(p+i+24));}
   out[t]=hsum256(_mm256_add_ps(_mm256_add_ps(s0,s1),_mm256_add_ps(s2,s3))); }
 return out[0]+out[1]; }
/* gemv over all calls, dynamic chunks of cr rows */
TGT void run_dyn(int64_t ncalls,const float**Ws,const int64_t*Ns,const int64_t*Ks,const float**xs,float**ys,int nth,int64_t cr){
#pragma omp parallel num_threads(nth)
  for(int64_t i=0;i<ncalls;i++){
#pragma omp for schedule(dynamic,1)
    for(int64_t c=0;c<Ns[i];c+=cr) for(int64_t n0=c;n0<c+cr&&n0<Ns[i];n0+=4) tile(xs[i],Ks[i],Ws[i],Ns[i],ys[i],n0,0);
  }
}

TGT static void tile2(const float *x,int64_t K,const float*W,int64_t N,float*y,int64_t n0,int v){
  const float*w[4]; int64_t nr=N-n0<4?N-n0:4; float out[4];
  for(int r=0;r<4;r++) w[r]=W+(n0+(r<nr?r:nr-1))*K;
  for(int r=0;r<4;r++){
    __m256 a0=_mm256_setzero_ps(),a1=a0,a2=a0,a3=a0;
    if(v==6){ for(int64_t k=0;k<K;k+=16){ _mm_prefetch((const char*)(w[r]+k+1024),_MM_HINT_T0);
        a0=_mm256_fmadd_ps(_mm256_loadu_ps(w[r]+k),_mm256_loadu_ps(x+k),a0); a1=_mm256_fmadd_ps(_mm256_loadu_ps(w[r]+k+8),_mm256_loadu_ps(x+k+8),a1);} }
    else if(v==7){ for(int64_t k=0;k<K;k+=32){ _mm_prefetch((const char*)(w[r]+k+1024),_MM_HINT_T0);_mm_prefetch((const char*)(w[r]+k+1040),_MM_HINT_T0);
        a0=_mm256_fmadd_ps(_mm256_loadu_ps(w[r]+k),_mm256_loadu_ps(x+k),a0); a1=_mm256_fmadd_ps(_mm256_loadu_ps(w[r]+k+8),_mm256_loadu_ps(x+k+8),a1);
        a2=_mm256_fmadd_ps(_mm256_loadu_ps(w[r]+k+16),_mm256_loadu_ps(x+k+16),a2); a3=_mm256_fmadd_ps(_mm256_loadu_ps(w[r]+k+24),_mm256_loadu_ps(x+k+24),a3);} }
    else { int64_t d = v==8?512:2048; for(int64_t k=0;k<K;k+=8){ if((k&8)==0)_mm_prefetch((const char*)(w[r]+k+d),_MM_HINT_T0);
        a0=_mm256_fmadd_ps(_mm256_loadu_ps(w[r]+k),_mm256_loadu_ps(x+k),a0);} }
    out[r]=hsum256(_mm256_add_ps(_mm256_add_ps(a0,a1),_mm256_add_ps(a2,a3)));
  }
  for(int r=0;r<nr;r++) y[n0+r]=out[r];
}
TGT void run_v(int64_t ncalls,const float**Ws,const int64_t*Ns,const int64_t*Ks,const float**xs,float**ys,int v,int nth){
#pragma omp parallel num_threads(nth)
  for(int64_t i=0;i<ncalls;i++){
#pragma omp for schedule(static)
      for(int64_t n0=0;n0<Ns[i];n0+=4) tile2(xs[i],Ks[i],Ws[i],Ns[i],ys[i],n0,v);
  }
}
TGT static inline void touch(const float*p, int64_t nfl){ __m256 acc=_mm256_setzero_ps();
  for(int64_t i=0;i<nfl;i+=16) acc=_mm256_or_ps(acc,_mm256_loadu_ps(p+i));
  __asm__ volatile("" :: "x"(acc)); }
TGT static inline void share(int64_t N,int t,int T,int64_t*a,int64_t*b){ int64_t tiles=(N+3)/4, q=tiles/T, r=tiles%T;
  int64_t s=t*q+(t<r?t:r), e=s+q+(t<r?1:0); *a=s*4; *b=e*4<N?e*4:N; }
/* manual static split; at the end of its share each thread touches the first `ahead` floats of its next share (mode 1) or prefetches them (mode 2) */
TGT void run_ahead(int64_t ncalls,const float**Ws,const int64_t*Ns,const int64_t*Ks,const float**xs,float**ys,int nth,int64_t ahead,int mode){
#pragma omp parallel num_threads(nth)
 { int t=omp_get_thread_num(),T=omp_get_num_threads();
  for(int64_t i=0;i<ncalls;i++){
    int64_t a,b; share(Ns[i],t,T,&a,&b);
    for(int64_t n0=a;n0<b;n0+=4) tile(xs[i],Ks[i],Ws[i],Ns[i],ys[i],n0,0);
    if(i+1<ncalls && ahead>0){ int64_t a2,b2; share(Ns[i+1],t,T,&a2,&b2); int64_t len=(b2-a2)*Ks[i+1]; if(len>ahead)len=ahead;
       const float*p=Ws[i+1]+a2*Ks[i+1];
       if(mode==1) touch(p,len); else for(int64_t j=0;j<len;j+=16)_mm_prefetch((const char*)(p+j),_MM_HINT_T1); }
#pragma omp barrier
  } }
}
/* per-thread pieces: piece[i*T+t] points to rows [a,b) of call i stored contiguously; barrier between calls */
TGT void run_pieces(int64_t ncalls,const float**piece,const int64_t*Ns,const int64_t*Ks,const float**xs,float**ys,int nth){
#pragma omp parallel num_threads(nth)
 { int t=omp_get_thread_num(),T=omp_get_num_threads();
  for(int64_t i=0;i<ncalls;i++){
    int64_t a,b; share(Ns[i],t,T,&a,&b);
    const float*base=piece[i*T+t]-a*Ks[i]; /* so that row n is at base + n*K */
    for(int64_t n0=a;n0<b;n0+=4) tile(xs[i],Ks[i],base,b,ys[i],n0,0);
#pragma omp barrier
  } }
}
#include <stdatomic.h>
/* T ranges of tiles; range r packed (lo | hi << 32) in rng[r]; owner claims chunk from lo, others steal from hi */
static _Atomic uint64_t rng_[64*8];
TGT static inline int claim_front(_Atomic uint64_t *r, int64_t ch, int64_t *a, int64_t *b){
  uint64_t v=atomic_load_explicit(r,memory_order_relaxed);
  for(;;){ int64_t lo=(int64_t)(v&0xffffffffu), hi=(int64_t)(v>>32); if(lo>=hi) return 0;
    int64_t nl=lo+ch<hi?lo+ch:hi; uint64_t nv=(uint64_t)nl|((uint64_t)hi<<32);
    if(atomic_compare_exchange_weak_explicit(r,&v,nv,memory_order_relaxed,memory_order_relaxed)){*a=lo;*b=nl;return 1;} } }
TGT static inline int claim_back(_Atomic uint64_t *r, int64_t ch, int64_t *a, int64_t *b){
  uint64_t v=atomic_load_explicit(r,memory_order_relaxed);
  for(;;){ int64_t lo=(int64_t)(v&0xffffffffu), hi=(int64_t)(v>>32); if(lo>=hi) return 0;
    int64_t nh=hi-ch>lo?hi-ch:lo; uint64_t nv=(uint64_t)lo|((uint64_t)nh<<32);
    if(atomic_compare_exchange_weak_explicit(r,&v,nv,memory_order_relaxed,memory_order_relaxed)){*a=nh;*b=hi;return 1;} } }
TGT void run_steal(int64_t ncalls,const float**Ws,const int64_t*Ns,const int64_t*Ks,const float**xs,float**ys,int nth,int64_t ch){
#pragma omp parallel num_threads(nth)
 { int t=omp_get_thread_num(),T=omp_get_num_threads();
  for(int64_t i=0;i<ncalls;i++){
    int64_t tiles=(Ns[i]+3)/4, q=tiles/T, r=tiles%T;
    int64_t s=t*q+(t<r?t:r), e=s+q+(t<r?1:0);
    _Atomic uint64_t *mine=&rng_[(i&1)*64*4+t*8]; /* two sets alternate: set i is reset before the barrier of i-1 ends */
    atomic_store_explicit(mine,(uint64_t)s|((uint64_t)e<<32),memory_order_relaxed);
    if(ch<0){
#pragma omp barrier
    }
    if(ch<0) ch=-ch;
    int64_t a,b;
    while(claim_front(mine,ch,&a,&b)) for(int64_t x=a;x<b;x++) tile(xs[i],Ks[i],Ws[i],Ns[i],ys[i],4*x,0);
    for(int o=1;o<T;o++){ _Atomic uint64_t *other=&rng_[(i&1)*64*4+((t+o)%T)*8];
      while(claim_back(other,ch,&a,&b)) for(int64_t x=a;x<b;x++) tile(xs[i],Ks[i],Ws[i],Ns[i],ys[i],4*x,0); }
#pragma omp barrier
  } }
}
