/* dyncompile SparseRowsMatMul: an ONNX Runtime custom operator (domain "dyncompile") that reads only the weight
 * rows whose activation is above a threshold.
 *
 *   Y[m, :] = sum over i (ascending) with |X[m, i]| > threshold of X[m, i] * W[i, :]
 *
 * X: float [..., K]; W: float [K, N] (the MatMul's constant weight, row-major); Y: float [..., N].
 * Batch-1 decode is memory-bound: a skipped row is never read. Each row is a contiguous axpy (one fused
 * multiply-add per element, fmaf: the same rounding whether the compiler vectorises it or not).
 *
 * Determinism: K is cut into two fixed halves and each output element is (ascending sum over the active rows of
 * the first half) + (ascending sum over the active rows of the second half), whatever M, the number of threads or
 * which thread runs a task: a k-row call gives bit-identical rows to k one-row calls (speculative verification of a
 * sparse target stays token-identical to the sparse target alone). The work is cut in fixed tasks run through ORT's
 * intra-op pool (KernelContext_ParallelFor): SR_CHUNKS chunks of the N columns, each summing both halves for its
 * columns; several rows loop K in blocks so that a block of weight rows is reused from cache across the rows. One
 * row whose column chunks would be short (N * 4 bytes < SR_CHUNKS * SR_SHORT_RUN_BYTES, e.g. a down projection of
 * 1,536 columns: 3 KB a chunk) runs the two halves as the two tasks instead, each over all N columns, so each
 * thread reads whole weight rows, one contiguous run per active row (on a 2-core AMD EPYC VM that made the 8960 x
 * 1536 projection about 1.2x faster at 25-40 % sparsity; the 1536 x 8960 one, 17.5 KB a chunk, did not gain).
 *
 * Many rows (a prompt's prefill): a call of more than `dense_rows` rows (attribute; 0 = never) runs ONNX Runtime's
 * own MatMul (OrtApi::InvokeOp, MLAS's blocked GEMM) on a copy of X with the entries at or below the threshold set
 * to zero: the same product up to float round-off, since the union of many rows' active sets is nearly all of K and
 * a GEMM reuses each weight row across rows far better than the per-row axpy above. Those rows are not
 * bit-identical to one-row calls; the pass sets dense_rows above the largest verification call a drafter makes (a
 * tree's nodes + the root), so verification stays on the bit-identical path.
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
#define SR_CHUNKS 2       /* column chunks of a several-row call (>= 2: the one-row call's two half tasks use
                             * their scratch); fixed, so results do not depend on the thread count */
#define SR_BLOCK_BYTES (192 * 1024)
#define SR_SHORT_RUN_BYTES 8192 /* a one-row call whose column chunks would read shorter runs of each row than this
                                 * splits K between the threads instead */

static const OrtApi *g_ort = NULL;

typedef struct {
  float threshold;
  int64_t dense_rows; /* more rows than this: ORT's MatMul on the thresholded X (0: never) */
  OrtOp *matmul;
  OrtMemoryInfo *cpu;
} SrKernel;

typedef struct {
  const float *x;
  const float *w;
  float *y;
  float *tmp;   /* the second half's sums: n floats (one row) or m x n (several rows) */
  int64_t *act; /* per task (SR_CHUNKS of them, each k long): the active rows of a block, and their values */
  float *av;
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

/* y += the second half's sums: the one addition that joins the two halves, the same for every path. */
static void sr_add(float *restrict y, const float *restrict tmp, int64_t len) {
  for (int64_t j = 0; j < len; ++j) y[j] += tmp[j];
}

/* Whether entry a of X is kept (its weight row read): the one test both paths use, so the MatMul path's zeros are
 * exactly the rows the row path skips. */
static inline int sr_kept(float a, float t) { return fabsf(a) > t; }

/* The first row of the second half: K is cut in two fixed halves, whatever M or the thread count. */
static int64_t sr_half(int64_t k) { return (k + 1) / 2; }

/* dst[r, :len] (row stride ldd) = sum over i in [i0, i1) ascending with |x[r, i]| > t of x[r, i] * w[i, c0:c0+len],
 * for the m rows. Several rows loop K in blocks so that a block of weight rows is reused from cache across them. */
static void sr_accumulate(const SrWork *s, int64_t c0, int64_t len, int64_t i0, int64_t i1, float *dst, int64_t ldd,
                          int64_t *act, float *av, int64_t kb) {
  for (int64_t r = 0; r < s->m; ++r) memset(dst + r * ldd, 0, (size_t)len * sizeof(float));
  const float *wc = s->w + c0;
  for (int64_t b0 = i0; b0 < i1; b0 += kb) {
    int64_t b1 = b0 + kb < i1 ? b0 + kb : i1;
    for (int64_t r = 0; r < s->m; ++r) {
      const float *xr = s->x + r * s->k;
      float *yr = dst + r * ldd;
      int64_t cnt = 0;
      for (int64_t i = b0; i < b1; ++i) {
        float a = xr[i];
        if (sr_kept(a, s->t)) {
          act[cnt] = i;
          av[cnt++] = a;
        }
      }
      int64_t p = 0;
      for (; p + 4 <= cnt; p += 4)
        sr_axpy4(yr, av + p, wc + act[p] * s->n, wc + act[p + 1] * s->n, wc + act[p + 2] * s->n,
                 wc + act[p + 3] * s->n, len);
      for (; p < cnt; ++p) sr_axpy(yr, av[p], wc + act[p] * s->n, len);
    }
  }
}

/* One row (decode): task idx sums its half of K over all N columns, into y (first half) or tmp (second). Each
 * thread then streams whole weight rows, one contiguous run per active row, instead of half of every row. */
static void sr_half_task(void *data, size_t idx) {
  const SrWork *s = (const SrWork *)data;
  int64_t h = sr_half(s->k), i0 = idx == 0 ? 0 : h, i1 = idx == 0 ? h : s->k;
  sr_accumulate(s, 0, s->n, i0, i1, idx == 0 ? s->y : s->tmp, s->n, s->act + idx * s->k, s->av + idx * s->k,
                i1 - i0 > 0 ? i1 - i0 : 1);
}

/* Several rows (prefill, verification): task idx takes a fixed chunk of the N columns and sums both halves of K
 * for it, the same two sums per element as sr_half_task, then adds them in the same order. */
static void sr_chunk(void *data, size_t idx) {
  const SrWork *s = (const SrWork *)data;
  int64_t per = (s->n + SR_CHUNKS - 1) / SR_CHUNKS;
  per = (per + 15) / 16 * 16;
  int64_t c0 = (int64_t)idx * per, c1 = c0 + per;
  if (c1 > s->n) c1 = s->n;
  if (c0 >= c1) return;
  int64_t len = c1 - c0;
  int64_t kb = s->m > 1 ? SR_BLOCK_BYTES / (int64_t)(len * sizeof(float)) : s->k; /* one row: nothing to reuse */
  if (kb < 8) kb = 8;
  if (kb > s->k) kb = s->k;
  int64_t *act = s->act + idx * s->k;
  float *av = s->av + idx * s->k;
  int64_t h = sr_half(s->k);
  sr_accumulate(s, c0, len, 0, h, s->y + c0, s->n, act, av, kb);
  sr_accumulate(s, c0, len, h, s->k, s->tmp + c0, s->n, act, av, kb);
  for (int64_t r = 0; r < s->m; ++r) sr_add(s->y + r * s->n + c0, s->tmp + r * s->n + c0, len);
}

static OrtStatus *sr_error(const char *msg) { return g_ort->CreateStatus(ORT_INVALID_ARGUMENT, msg); }


/* Many rows: Y = MatMul(X with |x| <= threshold set to 0, W), run by ONNX Runtime's own MatMul kernel. */
static OrtStatus *sr_dense(const SrKernel *kern, OrtKernelContext *ctx, const float *x, const OrtValue *wv,
                           OrtValue *yv, const int64_t *xd, size_t xr, int64_t m, int64_t k) {
  size_t count = (size_t)(m * k);
  float *xm = (float *)malloc(count * sizeof(float));
  if (xm == NULL) return g_ort->CreateStatus(ORT_FAIL, "SparseRowsMatMul: out of memory");
  const float t = kern->threshold;
  for (size_t i = 0; i < count; ++i) xm[i] = sr_kept(x[i], t) ? x[i] : 0.0f;
  OrtValue *xmv = NULL;
  OrtStatus *st = g_ort->CreateTensorWithDataAsOrtValue(kern->cpu, xm, count * sizeof(float), xd, xr,
                                                        ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, &xmv);
  if (st == NULL) {
    const OrtValue *in[2] = {xmv, wv};
    OrtValue *out[1] = {yv};
    st = g_ort->InvokeOp(ctx, kern->matmul, in, 2, out, 1);
    g_ort->ReleaseValue(xmv);
  }
  free(xm);
  return st;
}

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
  if (kern->matmul != NULL && m > kern->dense_rows)
    return sr_dense(kern, ctx, (const float *)xp, wv, yv, xd, xr, m, wd[0]);
  float *tmp = (float *)malloc((size_t)(m * wd[1]) * sizeof(float));
  int64_t *act = (int64_t *)malloc((size_t)(SR_CHUNKS * wd[0]) * sizeof(int64_t));
  float *av = (float *)malloc((size_t)(SR_CHUNKS * wd[0]) * sizeof(float));
  if (tmp == NULL || act == NULL || av == NULL) {
    free(tmp);
    free(act);
    free(av);
    return g_ort->CreateStatus(ORT_FAIL, "SparseRowsMatMul: out of memory");
  }
  SrWork work = {(const float *)xp, (const float *)wp, (float *)yp, tmp, act, av, m, wd[0], wd[1], kern->threshold};
  if (m == 1 && wd[1] * (int64_t)sizeof(float) < SR_CHUNKS * SR_SHORT_RUN_BYTES) {
    st = g_ort->KernelContext_ParallelFor(ctx, sr_half_task, 2, 0, &work);
    if (st == NULL) sr_add((float *)yp, tmp, wd[1]);
  } else {
    st = g_ort->KernelContext_ParallelFor(ctx, sr_chunk, SR_CHUNKS, 0, &work);
  }
  free(tmp);
  free(act);
  free(av);
  return st;
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
  st = g_ort->KernelInfoGetAttribute_int64(info, "dense_rows", &k->dense_rows);
  if (st != NULL) {
    g_ort->ReleaseStatus(st);
    k->dense_rows = 0;
  }
  if (k->dense_rows < 0) {
    free(k);
    return sr_error("SparseRowsMatMul: attribute dense_rows must be >= 0");
  }
  if (k->dense_rows > 0) {
    const char *names[1] = {"T"};
    ONNXTensorElementDataType types[1] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
    st = g_ort->CreateCpuMemoryInfo(OrtDeviceAllocator, OrtMemTypeDefault, &k->cpu);
    if (st == NULL) st = g_ort->CreateOp(info, "MatMul", "", 13, names, types, 1, NULL, 0, 2, 1, &k->matmul);
    if (st != NULL) {
      if (k->cpu != NULL) g_ort->ReleaseMemoryInfo(k->cpu);
      free(k);
      return st;
    }
  }
  *kernel = k;
  return NULL;
}

static void sr_destroy(void *p) {
  SrKernel *k = (SrKernel *)p;
  if (k == NULL) return;
  if (k->matmul != NULL) g_ort->ReleaseOp(k->matmul);
  if (k->cpu != NULL) g_ort->ReleaseMemoryInfo(k->cpu);
  free(k);
}
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
