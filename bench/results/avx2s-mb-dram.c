/* avx2s micro-bench 2: AVX2 Q8_0 kernels old vs new streaming rows from DRAM (one thread):
 * dot2 over consecutive row pairs and axpyn x8, 48 MiB per pass (beyond the 32 MiB L3), passes
 * alternating old/new over a 768 MiB buffer; median and min GB/s. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "pyrt.h"
#include "pyrt_internal.h"
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e9+t.tv_nsec;}
static int cmpd(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){
  const int n=2048; const int usepf=argc>2; const int fmt=argc>1&&argv[1][0]=='4'?PYRT_FMT_Q4_0:PYRT_FMT_Q8_0;
  size_t rb=pyrt_row_bytes(fmt,n), chunk=(48u<<20)/rb/8*8, nchunks=16, R=chunk*nchunks;
  uint8_t*rows=malloc(R*rb); for(size_t i=0;i<R*rb;i++) rows[i]=(uint8_t)(i*2654435761u>>13);
  for(size_t r=0;r<R;r++) for(int b=0;b<n/32;b++){uint16_t h=0x3000+((r*64+b)&0x3ff); memcpy(rows+r*rb+b*(rb/(n/32)),&h,2);}
  float*x=malloc(4*n),*y=malloc(4*n); for(int i=0;i<n;i++) x[i]=(float)((i*37)%1000-500)/500.f;
  pyrt_xq8*xq=malloc(sizeof(pyrt_xq8)*(n/32)); pyrt_quantize_x_q8(x,xq,n);
  const pyrt_row_ops*ops[2]={pyrt_row_ops_avx2_old(fmt, 0),pyrt_row_ops_avx2(fmt)};
  enum{P=24}; double g[2][2][P]; volatile float sink=0; size_t c=0;
  for(int p=0;p<P;p++) for(int v=0;v<2;v++) for(int k=0;k<2;k++){
    const uint8_t*base=rows+(c++%nchunks)*chunk*rb; double t0=now();
    static const void*pf[1024]; int npf;
    if(k==0){float o[2]; for(size_t r=0;r<chunk;r+=2){npf=0; if(usepf) for(size_t off=0;off<2*rb;off+=64) pf[npf++]=base+(r+4)*rb+off; ops[v]->dot2_pf(base+r*rb,base+(r+1)*rb,xq,n,o,pf,npf); sink+=o[0]+o[1];}}
    else {const void*rp[8]; float a[8]={.1f,.2f,.3f,.4f,.5f,.6f,.7f,.8f}; for(size_t r=0;r<chunk;r+=8){for(int j=0;j<8;j++) rp[j]=base+(r+j)*rb; npf=0; if(usepf) for(size_t off=0;off<8*rb;off+=64) pf[npf++]=base+(r+8)*rb+off; ops[v]->axpyn_pf(8,a,rp,y,n,pf,npf);}}
    g[k][v][p]=chunk*rb/(now()-t0);
  }
  const char*kn[2]={"dot2","axpyn x8"};
  for(int k=0;k<2;k++){double md[2],mx[2]; for(int v=0;v<2;v++){qsort(g[k][v],P,8,cmpd); md[v]=g[k][v][P/2]; mx[v]=g[k][v][P-1];}
    printf("%s %-9s %s from DRAM: old med %.2f max %.2f GB/s | new med %.2f max %.2f | new/old med %.3f max %.3f\n", fmt==PYRT_FMT_Q8_0?"Q8_0":"Q4_0", kn[k], usepf?"sw-pf":"no-pf", md[0],mx[0],md[1],mx[1],md[1]/md[0],mx[1]/mx[0]);}
  (void)sink; return 0;
}
