/* avx2s micro-bench: AVX2 Q8_0/Q4_0 kernels, old vs new, rows resident in L2 (compute-bound),
 * interleaved reps, min and median ns per row. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "pyrt.h"
#include "pyrt_internal.h"
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e9+t.tv_nsec;}
static int cmpd(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(void){
  const int n=2048, R=64; /* 64 rows x 2 KiB: 136 KB Q8_0, in L2 */
  const int fmts[2]={PYRT_FMT_Q8_0,PYRT_FMT_Q4_0}; const char*fn[2]={"Q8_0","Q4_0"};
  for(int f=0;f<2;f++){
    int fmt=fmts[f]; size_t rb=pyrt_row_bytes(fmt,n);
    uint8_t*rows=malloc(R*rb); for(size_t i=0;i<R*rb;i++) rows[i]=(uint8_t)(rand());
    for(int r=0;r<R;r++) for(int b=0;b<n/32;b++){uint16_t h=0x3000+(rand()&0x3ff); memcpy(rows+r*rb+b*(rb/(n/32)),&h,2);}
    float*x=malloc(4*n),*y=malloc(4*n); for(int i=0;i<n;i++) x[i]=(rand()%1000-500)/500.f;
    pyrt_xq8*xq=malloc(sizeof(pyrt_xq8)*(n/32)); pyrt_quantize_x_q8(x,xq,n);
    const pyrt_row_ops*ops[2]={pyrt_row_ops_avx2_old(fmt, 0),pyrt_row_ops_avx2(fmt)};
    enum{REPS=41}; double t[3][2][REPS]; volatile float sink=0;
    for(int rep=0;rep<REPS;rep++) for(int v=0;v<2;v++){
      double t0=now(); for(int it=0;it<20;it++) for(int r=0;r<R;r++) sink+=ops[v]->dot(rows+r*rb,xq,n);
      double t1=now(); float o[2]; for(int it=0;it<20;it++) for(int r=0;r<R;r+=2){ops[v]->dot2(rows+r*rb,rows+(r+1)*rb,xq,n,o); sink+=o[0];}
      double t2=now(); const void*rp[8]; float a[8]={.1f,.2f,.3f,.4f,.5f,.6f,.7f,.8f};
      for(int it=0;it<20;it++) for(int r=0;r<R;r+=8){for(int k=0;k<8;k++) rp[k]=rows+(r+k)*rb; ops[v]->axpyn(8,a,rp,y,n);}
      double t3=now();
      t[0][v][rep]=(t1-t0)/(20.*R); t[1][v][rep]=(t2-t1)/(20.*R); t[2][v][rep]=(t3-t2)/(20.*R);
    }
    const char*kn[3]={"dot","dot2 (per row)","axpyn x8 (per row)"};
    for(int k=0;k<3;k++){double m[2],md[2]; for(int v=0;v<2;v++){qsort(t[k][v],REPS,8,cmpd); m[v]=t[k][v][0]; md[v]=t[k][v][REPS/2];}
      printf("%s %-20s n=%d: old min %.1f med %.1f ns/row | new min %.1f med %.1f | new/old min %.3f med %.3f\n",fn[f],kn[k],n,m[0],md[0],m[1],md[1],m[1]/m[0],md[1]/md[0]);}
    (void)sink; free(rows);free(x);free(y);free(xq);
  }
}
