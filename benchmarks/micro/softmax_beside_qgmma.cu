// Microbenchmark, not part of the crate: how much a softmax-like instruction stream (per element
// FFMA, MUFU.EX2, FADD; or EX2 alone; or FFMA/FADD alone) slows down while another warpgroup on
// the same SM sub-partitions runs e4m3 QGMMAs (SS as one FP8 d128 Q·Kᵀ block, RS as one P·V
// block, or both), and beside a second such stream. Results:
// benchmarks/results/2026-11-30-h200-softmax-beside-qgmma.json. On a Hopper GPU:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a softmax_beside_qgmma.cu -o m && ./m
// The operands' contents do not matter (timing only); ptxas notes C7519 (an injected
// warpgroup.arrive), expected since nothing reads the accumulators between the GEMMs.
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// K-major, no swizzle, 128-byte leading and 256-byte stride offsets: any valid layout will do.
__device__ __forceinline__ uint64_t desc(uint32_t addr) {
  return uint64_t((addr >> 4) & 0x3fff) | uint64_t(128 >> 4) << 16 | uint64_t(256 >> 4) << 32;
}
__device__ __forceinline__ void ss_gemm(float* s, uint64_t da, uint64_t db, int acc) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %114, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n224k32.f32.e4m3.e4m3 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
      "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
      "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
      "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111"
      "}, %112, %113, p, 1, 1;\n}\n"
      : "+f"(s[0]), "+f"(s[1]), "+f"(s[2]), "+f"(s[3]), "+f"(s[4]), "+f"(s[5]),
        "+f"(s[6]), "+f"(s[7]), "+f"(s[8]), "+f"(s[9]), "+f"(s[10]), "+f"(s[11]),
        "+f"(s[12]), "+f"(s[13]), "+f"(s[14]), "+f"(s[15]), "+f"(s[16]), "+f"(s[17]),
        "+f"(s[18]), "+f"(s[19]), "+f"(s[20]), "+f"(s[21]), "+f"(s[22]), "+f"(s[23]),
        "+f"(s[24]), "+f"(s[25]), "+f"(s[26]), "+f"(s[27]), "+f"(s[28]), "+f"(s[29]),
        "+f"(s[30]), "+f"(s[31]), "+f"(s[32]), "+f"(s[33]), "+f"(s[34]), "+f"(s[35]),
        "+f"(s[36]), "+f"(s[37]), "+f"(s[38]), "+f"(s[39]), "+f"(s[40]), "+f"(s[41]),
        "+f"(s[42]), "+f"(s[43]), "+f"(s[44]), "+f"(s[45]), "+f"(s[46]), "+f"(s[47]),
        "+f"(s[48]), "+f"(s[49]), "+f"(s[50]), "+f"(s[51]), "+f"(s[52]), "+f"(s[53]),
        "+f"(s[54]), "+f"(s[55]), "+f"(s[56]), "+f"(s[57]), "+f"(s[58]), "+f"(s[59]),
        "+f"(s[60]), "+f"(s[61]), "+f"(s[62]), "+f"(s[63]), "+f"(s[64]), "+f"(s[65]),
        "+f"(s[66]), "+f"(s[67]), "+f"(s[68]), "+f"(s[69]), "+f"(s[70]), "+f"(s[71]),
        "+f"(s[72]), "+f"(s[73]), "+f"(s[74]), "+f"(s[75]), "+f"(s[76]), "+f"(s[77]),
        "+f"(s[78]), "+f"(s[79]), "+f"(s[80]), "+f"(s[81]), "+f"(s[82]), "+f"(s[83]),
        "+f"(s[84]), "+f"(s[85]), "+f"(s[86]), "+f"(s[87]), "+f"(s[88]), "+f"(s[89]),
        "+f"(s[90]), "+f"(s[91]), "+f"(s[92]), "+f"(s[93]), "+f"(s[94]), "+f"(s[95]),
        "+f"(s[96]), "+f"(s[97]), "+f"(s[98]), "+f"(s[99]), "+f"(s[100]), "+f"(s[101]),
        "+f"(s[102]), "+f"(s[103]), "+f"(s[104]), "+f"(s[105]), "+f"(s[106]), "+f"(s[107]),
        "+f"(s[108]), "+f"(s[109]), "+f"(s[110]), "+f"(s[111])
      : "l"(da), "l"(db), "r"(acc));
}
__device__ __forceinline__ void rs_gemm(float* o, const uint32_t* a, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
      "}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : "+f"(o[0]), "+f"(o[1]), "+f"(o[2]), "+f"(o[3]), "+f"(o[4]), "+f"(o[5]),
        "+f"(o[6]), "+f"(o[7]), "+f"(o[8]), "+f"(o[9]), "+f"(o[10]), "+f"(o[11]),
        "+f"(o[12]), "+f"(o[13]), "+f"(o[14]), "+f"(o[15]), "+f"(o[16]), "+f"(o[17]),
        "+f"(o[18]), "+f"(o[19]), "+f"(o[20]), "+f"(o[21]), "+f"(o[22]), "+f"(o[23]),
        "+f"(o[24]), "+f"(o[25]), "+f"(o[26]), "+f"(o[27]), "+f"(o[28]), "+f"(o[29]),
        "+f"(o[30]), "+f"(o[31]), "+f"(o[32]), "+f"(o[33]), "+f"(o[34]), "+f"(o[35]),
        "+f"(o[36]), "+f"(o[37]), "+f"(o[38]), "+f"(o[39]), "+f"(o[40]), "+f"(o[41]),
        "+f"(o[42]), "+f"(o[43]), "+f"(o[44]), "+f"(o[45]), "+f"(o[46]), "+f"(o[47]),
        "+f"(o[48]), "+f"(o[49]), "+f"(o[50]), "+f"(o[51]), "+f"(o[52]), "+f"(o[53]),
        "+f"(o[54]), "+f"(o[55]), "+f"(o[56]), "+f"(o[57]), "+f"(o[58]), "+f"(o[59]),
        "+f"(o[60]), "+f"(o[61]), "+f"(o[62]), "+f"(o[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// Warpgroup 0 times `iters` passes of a 112-element stream per thread (kind 0: FFMA, EX2, FADD
// per element as in the FP8 d128 softmax; 1: EX2 only; 2: FFMA, FADD, FFMA only). Warpgroup 1
// meanwhile (mode) 0: idles; 1: loops on 4 SS QGMMAs 64x224x32; 2: on 7 RS QGMMAs 64x128x32;
// 3: on both (one warpgroup's GEMMs of one key block); 4: runs the same stream.
__global__ void __launch_bounds__(256, 1)
    k(int mode, int kind, int iters, unsigned long long* cycles, float* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ volatile int done;
  const int wg = threadIdx.x / 128;
  for (int i = threadIdx.x; i < 200 * 1024 / 4; i += 256)
    reinterpret_cast<uint32_t*>(smem)[i] = 0x38383838u ^ i;
  if (threadIdx.x == 0) done = 0;
  __syncthreads();
  const uint32_t base = uint32_t(__cvta_generic_to_shared(smem));
  if (wg == 0 || mode == 4) {
    float v[112];
    for (int i = 0; i < 112; ++i) v[i] = -float((threadIdx.x + i) % 7) * 0.1f;
    float sum = 0.f;
    const float c = 1.0001f, b = 0.5f;
    const uint64_t t0 = clock64();
    for (int it = 0; it < iters; ++it) {
      if (kind == 0) {
#pragma unroll
        for (int i = 0; i < 112; ++i) {
          const float p = ex2(v[i] * c - b);
          sum += p;
          v[i] = p - 1.f;
        }
      } else if (kind == 1) {
#pragma unroll
        for (int i = 0; i < 112; ++i) v[i] = ex2(v[i]);
      } else {
#pragma unroll
        for (int i = 0; i < 112; ++i) {
          const float p = v[i] * c - b;
          sum += p;
          v[i] = p * c - b;
        }
      }
    }
    const uint64_t t1 = clock64();
    if (wg == 0) {
      if (threadIdx.x % 32 == 0) cycles[blockIdx.x * 4 + threadIdx.x / 32] = t1 - t0;
      done = 1;
    }
    sink[blockIdx.x * 256 + threadIdx.x] = sum;
  } else if (mode >= 1 && mode <= 3) {
    float s[112], o[64];
    const uint32_t a[4] = {0x38383838u, 0x30303030u, 0x38383838u, 0x30303030u};
    for (int i = 0; i < 112; ++i) s[i] = 0.f;
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    for (;;) {
      // Every warp of the warpgroup must run every wgmma: leave the loop all together.
      int stop;
      const int flag = done;
      asm volatile(
          "{\n.reg .pred p, q;\nsetp.ne.b32 q, %1, 0;\n"
          "bar.red.or.pred p, 1, 128, q;\nselp.b32 %0, 1, 0, p;\n}\n"
          : "=r"(stop)
          : "r"(flag));
      if (stop) break;
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
      if (mode & 1) {
        for (int kk = 0; kk < 4; ++kk)
          ss_gemm(s, desc(base + kk * 4096), desc(base + 65536 + kk * 8192), kk);
      }
      if (mode & 2) {
        for (int kk = 0; kk < 7; ++kk) rs_gemm(o, a, desc(base + 131072 + kk * 8192));
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
    float t = 0.f;
    for (int i = 0; i < 112; ++i) t += s[i];
    for (int i = 0; i < 64; ++i) t += o[i];
    sink[blockIdx.x * 256 + threadIdx.x] = t;
  }
}

int main() {
  const int sms = 132, iters = 2000;
  unsigned long long* cycles;
  float* sink;
  cudaMalloc(&cycles, sms * 4 * sizeof(unsigned long long));
  cudaMalloc(&sink, sms * 256 * sizeof(float));
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  const char* modes[] = {"alone", "beside SS QGMMA 64x224x32 x4", "beside RS QGMMA 64x128x32 x7",
                         "beside SS x4 + RS x7", "beside a second softmax stream"};
  const char* kinds[] = {"FFMA+EX2+FADD", "EX2 only", "FFMA+FADD+FFMA only"};
  for (int kind = 0; kind < 3; ++kind) {
    for (int mode = 0; mode < 5; ++mode) {
      if (kind > 0 && mode == 4) continue;
      k<<<sms, 256, 200 * 1024>>>(mode, kind, iters, cycles, sink);
      const cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess) {
        printf("error %s\n", cudaGetErrorString(e));
        return 1;
      }
      unsigned long long h[sms * 4];
      cudaMemcpy(h, cycles, sizeof h, cudaMemcpyDeviceToHost);
      double mean = 0;
      for (int i = 0; i < sms * 4; ++i) mean += double(h[i]) / (sms * 4);
      printf("%-20s mode %d %-34s cycles per 112-element pass per warp: %.0f\n", kinds[kind],
             mode, modes[mode], mean / iters);
    }
  }
}
