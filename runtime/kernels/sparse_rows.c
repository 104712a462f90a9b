/* dyncompile SparseRowsMatMul: an ONNX Runtime custom operator (domain "dyncompile") that reads only the weight
 * rows whose activation is above a threshold.
 *
 *   Y[m, :] = sum over i (ascending) with |X[m, i]| > threshold of X[m, i] * W[i, :]
 *
 * X: float [..., K]; W: float [K, N] (the MatMul's constant weight, row-major); Y: float [..., N].
 * Batch-1 decode is memory-bound: a skipped row is never read. Each row is a contiguous axpy (one fused
 * multiply-add per element, fmaf: the same rounding whether the compiler vectorises it or not).
 *
 * Determinism: the N columns are cut into SR_CHUNKS fixed chunks (never K), run through ORT's intra-op pool
 * (KernelContext_ParallelFor). For a given (m, j) the sum runs over i in ascending order whatever M, the
 * number of threads or which thread runs the chunk: a k-row call gives bit-identical rows to k one-row calls
 * (speculative verification of a sparse target stays token-identical to the sparse target alone). Several rows
 * (prefill) loop K in blocks so a block of weight rows is reused from cache across the rows; the order per
 * element is unchanged.
 *
 * Built into dyncompile's kernel library by dyncompile.runtime.kernels (with int8_epilogues.c and register.c) at
 * first use, with the system C compiler against onnxruntime_c_api.h.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "onnxruntime_c_api.h"

#define SR_API_VERSION 17 /* KernelContext_ParallelFor: ORT >= 1.17 */
#define SR_CHUNKS 2       /* column chunks: fixed, so results do not depend on the thread count */
#define SR_BLOCK_BYTES (192 * 1024)

static const OrtApi *g_ort = NULL;

typedef struct {
  float threshold;
} SrKernel;

typedef struct {
  const float *x;
  const float *w;
  float *y;
  int64_t m, k, n;
  float t;
} SrWork;

#if defined(__FMA__)
#define SR_FMA(a, b, c) fmaf((a), (b), (c))
#else
#define SR_FMA(a, b, c) ((c) + (a) * (b))
#endif

static void sr_axpy(float *restrict y, float a, const float *restrict w, int64_t len) {
  for (int64_t j = 0; j < len; ++j) y[j] = SR_FMA(a, w[j], y[j]);
}

/* four rows at once: y is read and written once for four weight rows. The nested fused multiply-adds round
 * exactly as four sr_axpy calls in a row, so grouping never changes a result. */
static void sr_axpy4(float *restrict y, const float *a, const float *restrict w0, const float *restrict w1,
                     const float *restrict w2, const float *restrict w3, int64_t len) {
  const float a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
  for (int64_t j = 0; j < len; ++j)
    y[j] = SR_FMA(a3, w3[j], SR_FMA(a2, w2[j], SR_FMA(a1, w1[j], SR_FMA(a0, w0[j], y[j]))));
}

static void sr_chunk(void *data, size_t idx) {
  const SrWork *s = (const SrWork *)data;
  int64_t per = (s->n + SR_CHUNKS - 1) / SR_CHUNKS;
  per = (per + 15) / 16 * 16;
  int64_t c0 = (int64_t)idx * per, c1 = c0 + per;
  if (c1 > s->n) c1 = s->n;
  if (c0 >= c1) return;
  int64_t len = c1 - c0;
  for (int64_t r = 0; r < s->m; ++r) memset(s->y + r * s->n + c0, 0, (size_t)len * sizeof(float));
  int64_t kb = s->m > 1 ? SR_BLOCK_BYTES / (int64_t)(len * sizeof(float)) : s->k;
  if (kb < 8) kb = 8;
  if (kb > s->k) kb = s->k;
  int64_t *act = (int64_t *)malloc((size_t)kb * sizeof(int64_t));
  float *av = (float *)malloc((size_t)kb * sizeof(float));
  if (act == NULL || av == NULL) { /* cannot happen in practice; fall back to one row at a time */
    free(act);
    free(av);
    for (int64_t r = 0; r < s->m; ++r)
      for (int64_t i = 0; i < s->k; ++i) {
        float a = s->x[r * s->k + i];
        if (fabsf(a) > s->t) sr_axpy(s->y + r * s->n + c0, a, s->w + i * s->n + c0, len);
      }
    return;
  }
  for (int64_t i0 = 0; i0 < s->k; i0 += kb) {
    int64_t i1 = i0 + kb < s->k ? i0 + kb : s->k;
    for (int64_t r = 0; r < s->m; ++r) {
      const float *xr = s->x + r * s->k;
      float *yr = s->y + r * s->n + c0;
      int64_t cnt = 0;
      for (int64_t i = i0; i < i1; ++i) {
        float a = xr[i];
        if (fabsf(a) > s->t) {
          act[cnt] = i;
          av[cnt++] = a;
        }
      }
      const float *wc = s->w + c0;
      int64_t p = 0;
      for (; p + 4 <= cnt; p += 4)
        sr_axpy4(yr, av + p, wc + act[p] * s->n, wc + act[p + 1] * s->n, wc + act[p + 2] * s->n,
                 wc + act[p + 3] * s->n, len);
      for (; p < cnt; ++p) sr_axpy(yr, av[p], wc + act[p] * s->n, len);
    }
  }
  free(act);
  free(av);
}

static OrtStatus *sr_error(const char *msg) { return g_ort->CreateStatus(ORT_INVALID_ARGUMENT, msg); }


static OrtStatus *sr_compute(void *op_kernel, OrtKernelContext *ctx) {
  const SrKernel *kern = (const SrKernel *)op_kernel;
  const OrtValue *xv = NULL, *wv = NULL;
  OrtStatus *st;
  if ((st = g_ort->KernelContext_GetInput(ctx, 0, &xv)) != NULL) return st;
  if ((st = g_ort->KernelContext_GetInput(ctx, 1, &wv)) != NULL) return st;
  OrtTensorTypeAndShapeInfo *xi = NULL, *wi = NULL;
  if ((st = g_ort->GetTensorTypeAndShape(xv, &xi)) != NULL) return st;
  if ((st = g_ort->GetTensorTypeAndShape(wv, &wi)) != NULL) {
    g_ort->ReleaseTensorTypeAndShapeInfo(xi);
    return st;
  }
  size_t xr = 0, wr = 0;
  int64_t xd[8], wd[2];
  g_ort->GetDimensionsCount(xi, &xr);
  g_ort->GetDimensionsCount(wi, &wr);
  if (xr < 1 || xr > 8 || wr != 2) {
    g_ort->ReleaseTensorTypeAndShapeInfo(xi);
    g_ort->ReleaseTensorTypeAndShapeInfo(wi);
    return sr_error("SparseRowsMatMul: X must have rank 1..8 and W rank 2");
  }
  g_ort->GetDimensions(xi, xd, xr);
  g_ort->GetDimensions(wi, wd, 2);
  g_ort->ReleaseTensorTypeAndShapeInfo(xi);
  g_ort->ReleaseTensorTypeAndShapeInfo(wi);
  if (xd[xr - 1] != wd[0]) return sr_error("SparseRowsMatMul: X's last dimension differs from W's rows");
  int64_t m = 1;
  for (size_t d = 0; d + 1 < xr; ++d) m *= xd[d];
  int64_t yd[8];
  memcpy(yd, xd, xr * sizeof(int64_t));
  yd[xr - 1] = wd[1];
  OrtValue *yv = NULL;
  if ((st = g_ort->KernelContext_GetOutput(ctx, 0, yd, xr, &yv)) != NULL) return st;
  const void *xp = NULL, *wp = NULL;
  void *yp = NULL;
  if ((st = g_ort->GetTensorData(xv, &xp)) != NULL) return st;
  if ((st = g_ort->GetTensorData(wv, &wp)) != NULL) return st;
  if ((st = g_ort->GetTensorMutableData(yv, &yp)) != NULL) return st;
  if (m == 0 || wd[1] == 0) return NULL;
  SrWork work = {(const float *)xp, (const float *)wp, (float *)yp, m, wd[0], wd[1], kern->threshold};
  return g_ort->KernelContext_ParallelFor(ctx, sr_chunk, SR_CHUNKS, 0, &work);
}

static OrtStatus *sr_create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **kernel) {
  (void)op;
  (void)api;
  SrKernel *k = (SrKernel *)calloc(1, sizeof(SrKernel));
  if (k == NULL) return g_ort->CreateStatus(ORT_FAIL, "SparseRowsMatMul: out of memory");
  OrtStatus *st = g_ort->KernelInfoGetAttribute_float(info, "threshold", &k->threshold);
  if (st != NULL) {
    g_ort->ReleaseStatus(st);
    k->threshold = 0.0f;
  }
  if (!(k->threshold >= 0.0f)) {
    free(k);
    return sr_error("SparseRowsMatMul: attribute threshold must be >= 0");
  }
  *kernel = k;
  return NULL;
}

static void sr_destroy(void *k) { free(k); }
static const char *sr_name(const OrtCustomOp *op) { (void)op; return "SparseRowsMatMul"; }
static const char *sr_ep(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static ONNXTensorElementDataType sr_type(const OrtCustomOp *op, size_t i) {
  (void)op; (void)i;
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static size_t sr_two(const OrtCustomOp *op) { (void)op; return 2; }
static size_t sr_one(const OrtCustomOp *op) { (void)op; return 1; }
static OrtCustomOpInputOutputCharacteristic sr_required(const OrtCustomOp *op, size_t i) {
  (void)op; (void)i;
  return INPUT_OUTPUT_REQUIRED;
}
static OrtMemType sr_mem(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return OrtMemTypeDefault; }
static int sr_arity(const OrtCustomOp *op) { (void)op; return 1; }
static int sr_homog(const OrtCustomOp *op) { (void)op; return 1; }
static int sr_start(const OrtCustomOp *op) { (void)op; return 1; }
static int sr_end(const OrtCustomOp *op) { (void)op; return 1 << 30; }

static OrtCustomOp g_op;

/* Called by RegisterCustomOps (register.c): adds SparseRowsMatMul to the "dyncompile" domain. */
OrtStatus *dc_add_sparse_rows_ops(const OrtApi *api, OrtCustomOpDomain *domain) {
  g_ort = api;
  memset(&g_op, 0, sizeof(g_op));
  g_op.version = SR_API_VERSION;
  g_op.GetName = sr_name;
  g_op.GetExecutionProviderType = sr_ep;
  g_op.GetInputType = sr_type;
  g_op.GetInputTypeCount = sr_two;
  g_op.GetOutputType = sr_type;
  g_op.GetOutputTypeCount = sr_one;
  g_op.KernelDestroy = sr_destroy;
  g_op.GetInputCharacteristic = sr_required;
  g_op.GetOutputCharacteristic = sr_required;
  g_op.GetInputMemoryType = sr_mem;
  g_op.GetVariadicInputMinArity = sr_arity;
  g_op.GetVariadicInputHomogeneity = sr_homog;
  g_op.GetVariadicOutputMinArity = sr_arity;
  g_op.GetVariadicOutputHomogeneity = sr_homog;
  g_op.CreateKernelV2 = sr_create;
  g_op.KernelComputeV2 = sr_compute;
  g_op.GetStartVersion = sr_start;
  g_op.GetEndVersion = sr_end;
  return g_ort->CustomOpDomain_Add(domain, &g_op);
}
