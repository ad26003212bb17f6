#include "../../../../../src/diffspec/packed_linear.c"
#include <stdlib.h>
#include <stdio.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){ int64_t K=576,N=1536,R=atoi(argv[1]); int th=atoi(argv[2]);
 uint8_t *q=malloc(N*K/2); float *d=malloc(N*K/32*4),*m=malloc(N*K/32*4),*x=aligned_alloc(64,64*K*4),*y=malloc(64*N*4);
 for(int64_t i=0;i<N*K/2;i++)q[i]=rand(); for(int64_t i=0;i<N*K/32;i++){d[i]=1e-3f;m[i]=-1e-2f;} for(int64_t i=0;i<64*K;i++)x[i]=0.01f*(i%7);
 double best=1e9; for(int t=0;t<5;t++){ double t0=now(); for(int r=0;r<500;r++) diffspec_q4_linear(x,R,K,q,d,m,N,y,th); double e=(now()-t0)/500; if(e<best)best=e;}
 double fma=(double)K/16*N*R; printf("R=%ld threads=%d: %.1f us, %.2f G zmm-FMA/s (%.0f%% of %d x 3.58)\n",R,th,best*1e6,fma/best/1e9,100*fma/best/1e9/(3.58*th),th); return 0;}
