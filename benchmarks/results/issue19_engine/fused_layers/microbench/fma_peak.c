#include <stdio.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  long N=100000000; double t=now();
  __asm__ volatile(
    "vxorps %%zmm0,%%zmm0,%%zmm0\n vxorps %%zmm1,%%zmm1,%%zmm1\n vxorps %%zmm2,%%zmm2,%%zmm2\n vxorps %%zmm3,%%zmm3,%%zmm3\n"
    "vxorps %%zmm4,%%zmm4,%%zmm4\n vxorps %%zmm5,%%zmm5,%%zmm5\n vxorps %%zmm6,%%zmm6,%%zmm6\n vxorps %%zmm7,%%zmm7,%%zmm7\n"
    "vxorps %%zmm8,%%zmm8,%%zmm8\n vxorps %%zmm9,%%zmm9,%%zmm9\n vxorps %%zmm10,%%zmm10,%%zmm10\n vxorps %%zmm11,%%zmm11,%%zmm11\n"
    "1:\n"
    "vfmadd231ps %%zmm12,%%zmm13,%%zmm0\n vfmadd231ps %%zmm12,%%zmm13,%%zmm1\n vfmadd231ps %%zmm12,%%zmm13,%%zmm2\n vfmadd231ps %%zmm12,%%zmm13,%%zmm3\n"
    "vfmadd231ps %%zmm12,%%zmm13,%%zmm4\n vfmadd231ps %%zmm12,%%zmm13,%%zmm5\n vfmadd231ps %%zmm12,%%zmm13,%%zmm6\n vfmadd231ps %%zmm12,%%zmm13,%%zmm7\n"
    "vfmadd231ps %%zmm12,%%zmm13,%%zmm8\n vfmadd231ps %%zmm12,%%zmm13,%%zmm9\n vfmadd231ps %%zmm12,%%zmm13,%%zmm10\n vfmadd231ps %%zmm12,%%zmm13,%%zmm11\n"
    "dec %0\n jnz 1b\n" : "+r"(N) :: "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","xmm12","xmm13");
  t=now()-t; printf("%.2f G zmm-FMA/s per core\n", 100000000.0*12/t/1e9);
  N=100000000; t=now();
  __asm__ volatile(
    "1:\n"
    "vfmadd231ps %%ymm12,%%ymm13,%%ymm0\n vfmadd231ps %%ymm12,%%ymm13,%%ymm1\n vfmadd231ps %%ymm12,%%ymm13,%%ymm2\n vfmadd231ps %%ymm12,%%ymm13,%%ymm3\n"
    "vfmadd231ps %%ymm12,%%ymm13,%%ymm4\n vfmadd231ps %%ymm12,%%ymm13,%%ymm5\n vfmadd231ps %%ymm12,%%ymm13,%%ymm6\n vfmadd231ps %%ymm12,%%ymm13,%%ymm7\n"
    "vfmadd231ps %%ymm12,%%ymm13,%%ymm8\n vfmadd231ps %%ymm12,%%ymm13,%%ymm9\n vfmadd231ps %%ymm12,%%ymm13,%%ymm10\n vfmadd231ps %%ymm12,%%ymm13,%%ymm11\n"
    "dec %0\n jnz 1b\n" : "+r"(N) :: "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","xmm12","xmm13");
  t=now()-t; printf("%.2f G ymm-FMA/s per core\n", 100000000.0*12/t/1e9);
}
