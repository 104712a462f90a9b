/* dyncompile QuantizeRows and ScaledResidualAdd: the elementwise chains around an int8 MatMul, one kernel each.
 *
 * An encoder layer quantized with per-token (per-row) activation scales spends more kernels on the chain around
 * its int8 GEMMs than on the GEMMs' neighbours in float: ReduceMax -> Mul -> Max -> QuantizeLinear (the zero
 * point) -> QuantizeLinear (the rows) before the MatMul, and Mul (the row scale) -> Add (bias) -> Add (residual)
 * after it. Each reads and writes the whole [rows, width] tensor and costs ORT a kernel dispatch. These two
 * operators do each chain in one pass (the `fuse-int8-epilogues` pass rewrites the graph to them), with the same
 * float operations in the same order as the kernels they replace, so their outputs are bit-identical:
 *
 * QuantizeRows (X float [..., K]) -> (Q uint8 [..., K], S float [..., 1]), attributes inv_range, floor, absolute:
 *   S[m] = max(max_k(absolute ? |X[m, k]| : X[m, k]) * inv_range, floor)
 *   Q[m, k] = saturate_uint8(round_half_even(X[m, k] / S[m]) + 128)
 *
 * ScaledResidualAdd (X float [..., N], S float [..., 1], B float [N], R float [..., N]) -> H float [..., N]:
 *   H[m, n] = ((X[m, n] * S[m]) + B[n]) + R[m, n]     (one rounding per operation: -std=c11 contracts nothing)
 *
 * (The LayerNormalization after the residual stays ONNX Runtime's: its summation order is not reproduced here,
 * and a 1-ulp change there moves the next per-tensor int8 rounding, so an early-exit plan would calibrate to
 * different exits.) Rows are independent and each is computed the same way whatever the row count or thread
 * count (rows are split over ORT's intra-op pool in whole rows).
 *
 * Built into dyncompile's kernel library by dyncompile.runtime.kernels (with sparse_rows.c and register.c).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "onnxruntime_c_api.h"

#define EP_API_VERSION 17 /* KernelContext_ParallelFor, shape inference of custom ops: ORT >= 1.17 */
#define EP_LANES 16
#define QR_PARALLEL_MIN (1 << 15) /* elements below which one thread quantizes the whole call */
#define SA_PARALLEL_MIN (1 << 15) /* ... sums it */

static const OrtApi *g_ort = NULL;

static OrtStatus *ep_error(const char *msg) { return g_ort->CreateStatus(ORT_INVALID_ARGUMENT, msg); }

static OrtStatus *ep_shape(const OrtValue *v, int64_t *dims, size_t *rank) {
  OrtTensorTypeAndShapeInfo *info = NULL;
  OrtStatus *st = g_ort->GetTensorTypeAndShape(v, &info);
  if (st != NULL) return st;
  if ((st = g_ort->GetDimensionsCount(info, rank)) == NULL) {
    if (*rank > 8)
      st = ep_error("dyncompile int8 epilogue: tensors of rank above 8 are not supported");
    else
      st = g_ort->GetDimensions(info, dims, *rank);
  }
  g_ort->ReleaseTensorTypeAndShapeInfo(info);
  return st;
}

static int64_t ep_count(const int64_t *dims, size_t rank) {
  int64_t n = 1;
  for (size_t i = 0; i < rank; ++i) n *= dims[i];
  return n;
}

/* Run rows [0, m) through fn in whole-row chunks on ORT's pool (one thread for small calls). */
typedef struct {
  void (*rows)(const void *work, int64_t m0, int64_t m1);
  const void *work;
  int64_t m, chunks;
} EpSplit;

static void ep_chunk(void *data, size_t idx) {
  const EpSplit *s = (const EpSplit *)data;
  int64_t per = (s->m + s->chunks - 1) / s->chunks, m0 = (int64_t)idx * per, m1 = m0 + per;
  if (m1 > s->m) m1 = s->m;
  if (m0 < m1) s->rows(s->work, m0, m1);
}

static OrtStatus *ep_run_rows(OrtKernelContext *ctx, void (*rows)(const void *, int64_t, int64_t), const void *work,
                              int64_t m, int64_t width, int64_t parallel_min) {
  if (m <= 1 || m * width < parallel_min) {
    rows(work, 0, m);
    return NULL;
  }
  EpSplit split = {rows, work, m, m < 8 ? m : 8};
  return g_ort->KernelContext_ParallelFor(ctx, ep_chunk, (size_t)split.chunks, 0, &split);
}

/* ---------------------------------------------------------------- QuantizeRows */

typedef struct {
  float inv_range, floor_;
  int absolute;
} QrKernel;

typedef struct {
  const float *x;
  uint8_t *q;
  float *s;
  int64_t k;
  const QrKernel *kern;
} QrWork;

/* One row: its scale, then its bytes. q = saturate(round_half_even(x / s) + 128), computed as clamp(round(x / s) +
 * 128, 0, 255) in float (exact: every value is an integer below 2^24), then converted. */
static float qr_scale(const float *restrict xr, int64_t k, const QrKernel *kern) {
  int64_t j = 0;
  float mx = -INFINITY;
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
  for (; j + 16 <= k; j += 16) {
    __m256 a = _mm256_loadu_ps(xr + j), b = _mm256_loadu_ps(xr + j + 8);
    if (kern->absolute) {
      a = _mm256_andnot_ps(sign, a);
      b = _mm256_andnot_ps(sign, b);
    }
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
  }
  float lane[8];
  _mm256_storeu_ps(lane, _mm256_max_ps(m0, m1));
  for (int l = 0; l < 8; ++l) mx = lane[l] > mx ? lane[l] : mx;
#endif
  for (; j < k; ++j) {
    float a = kern->absolute ? fabsf(xr[j]) : xr[j];
    mx = a > mx ? a : mx;
  }
  float sc = mx * kern->inv_range;
  return sc > kern->floor_ ? sc : kern->floor_; /* Max(s, floor): floor > 0, so never 0 */
}

static void qr_rows(const void *data, int64_t m0, int64_t m1) {
  const QrWork *w = (const QrWork *)data;
  const int64_t k = w->k;
  for (int64_t m = m0; m < m1; ++m) {
    const float *restrict xr = w->x + m * k;
    uint8_t *restrict qr = w->q + m * k;
    const float sc = qr_scale(xr, k, w->kern);
    w->s[m] = sc;
    int64_t j = 0;
#if defined(__AVX2__)
    const __m256 vs = _mm256_set1_ps(sc), c128 = _mm256_set1_ps(128.0f), lo = _mm256_setzero_ps(),
                 hi = _mm256_set1_ps(255.0f);
    for (; j + 8 <= k; j += 8) {
      __m256 v = _mm256_div_ps(_mm256_loadu_ps(xr + j), vs);
      v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(v, c128), lo), hi);
      __m256i i = _mm256_cvtps_epi32(v);
      __m128i p16 = _mm_packus_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
      _mm_storel_epi64((__m128i *)(qr + j), _mm_packus_epi16(p16, p16));
    }
#endif
    for (; j < k; ++j) {
      float v = xr[j] / sc;
      v = v < -512.0f ? -512.0f : (v > 512.0f ? 512.0f : v); /* saturates the same below; keeps the trick exact */
      v = (v + 12582912.0f) - 12582912.0f;                   /* round half to even (|v| < 2^22) */
      v = v + 128.0f;
      v = v < 0.0f ? 0.0f : (v > 255.0f ? 255.0f : v);
      qr[j] = (uint8_t)(int32_t)v;
    }
  }
}

static OrtStatus *qr_compute(void *op_kernel, OrtKernelContext *ctx) {
  const QrKernel *kern = (const QrKernel *)op_kernel;
  const OrtValue *xv = NULL;
  OrtStatus *st;
  if ((st = g_ort->KernelContext_GetInput(ctx, 0, &xv)) != NULL) return st;
  int64_t d[8];
  size_t r = 0;
  if ((st = ep_shape(xv, d, &r)) != NULL) return st;
  if (r < 1) return ep_error("QuantizeRows: X must have rank >= 1");
  int64_t k = d[r - 1], m = ep_count(d, r - 1);
  OrtValue *qv = NULL, *sv = NULL;
  if ((st = g_ort->KernelContext_GetOutput(ctx, 0, d, r, &qv)) != NULL) return st;
  int64_t ds[8];
  memcpy(ds, d, r * sizeof(int64_t));
  ds[r - 1] = 1;
  if ((st = g_ort->KernelContext_GetOutput(ctx, 1, ds, r, &sv)) != NULL) return st;
  const void *x = NULL;
  void *q = NULL, *s = NULL;
  if ((st = g_ort->GetTensorData(xv, &x)) != NULL) return st;
  if ((st = g_ort->GetTensorMutableData(qv, &q)) != NULL) return st;
  if ((st = g_ort->GetTensorMutableData(sv, &s)) != NULL) return st;
  if (m == 0) return NULL;
  if (k == 0) { /* ReduceMax of nothing is -inf in ORT; the scale is the floor */
    for (int64_t i = 0; i < m; ++i) ((float *)s)[i] = kern->floor_;
    return NULL;
  }
  QrWork work = {(const float *)x, (uint8_t *)q, (float *)s, k, kern};
  return ep_run_rows(ctx, qr_rows, &work, m, k, QR_PARALLEL_MIN);
}

static OrtStatus *qr_create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **kernel) {
  (void)op;
  (void)api;
  QrKernel *k = (QrKernel *)calloc(1, sizeof(QrKernel));
  if (k == NULL) return g_ort->CreateStatus(ORT_FAIL, "QuantizeRows: out of memory");
  OrtStatus *st;
  int64_t absolute = 0;
  if ((st = g_ort->KernelInfoGetAttribute_float(info, "inv_range", &k->inv_range)) != NULL ||
      (st = g_ort->KernelInfoGetAttribute_float(info, "floor", &k->floor_)) != NULL ||
      (st = g_ort->KernelInfoGetAttribute_int64(info, "absolute", &absolute)) != NULL) {
    g_ort->ReleaseStatus(st);
    free(k);
    return ep_error("QuantizeRows: attributes inv_range (float), floor (float) and absolute (int) are required");
  }
  if (!(k->floor_ > 0.0f) || !(k->inv_range > 0.0f) || isinf(k->inv_range) || isinf(k->floor_)) {
    free(k);
    return ep_error("QuantizeRows: inv_range and floor must be finite and > 0");
  }
  k->absolute = absolute != 0;
  *kernel = k;
  return NULL;
}

/* Q: X's shape as uint8; S: X's shape with a last dimension of 1. */
static OrtStatus *qr_infer(const OrtCustomOp *op, OrtShapeInferContext *ctx) {
  (void)op;
  OrtTensorTypeAndShapeInfo *in = NULL, *out = NULL;
  OrtStatus *st;
  if ((st = g_ort->ShapeInferContext_GetInputTypeShape(ctx, 0, &in)) != NULL) return st;
  size_t r = 0;
  int64_t d[8];
  const char *sym[8];
  if ((st = g_ort->GetDimensionsCount(in, &r)) == NULL) {
    if (r < 1 || r > 8)
      st = ep_error("QuantizeRows: X must have rank 1..8");
    else if ((st = g_ort->GetDimensions(in, d, r)) == NULL)
      st = g_ort->GetSymbolicDimensions(in, sym, r);
  }
  if (st != NULL) return st; /* `in` belongs to the context (never released here) */
  if ((st = g_ort->CreateTensorTypeAndShapeInfo(&out)) != NULL) return st;
  if ((st = g_ort->SetTensorElementType(out, ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8)) == NULL &&
      (st = g_ort->SetDimensions(out, d, r)) == NULL && (st = g_ort->SetSymbolicDimensions(out, sym, r)) == NULL)
    st = g_ort->ShapeInferContext_SetOutputTypeShape(ctx, 0, out);
  if (st == NULL) {
    d[r - 1] = 1;
    sym[r - 1] = "";
    if ((st = g_ort->SetTensorElementType(out, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)) == NULL &&
        (st = g_ort->SetDimensions(out, d, r)) == NULL && (st = g_ort->SetSymbolicDimensions(out, sym, r)) == NULL)
      st = g_ort->ShapeInferContext_SetOutputTypeShape(ctx, 1, out);
  }
  g_ort->ReleaseTensorTypeAndShapeInfo(out);
  return st;
}

/* ---------------------------------------------------------------- ScaledResidualAdd */

typedef struct {
  const float *x, *scale, *bias, *res;
  float *h;
  int64_t n;
} SaWork;

static void sa_rows(const void *data, int64_t m0, int64_t m1) {
  const SaWork *w = (const SaWork *)data;
  const int64_t n = w->n;
  const float *restrict b = w->bias;
  for (int64_t m = m0; m < m1; ++m) {
    const float *restrict xr = w->x + m * n, *restrict rr = w->res + m * n;
    float *restrict hr = w->h + m * n;
    const float sc = w->scale[m];
    for (int64_t j = 0; j < n; ++j) hr[j] = (xr[j] * sc + b[j]) + rr[j];
  }
}

static OrtStatus *sa_compute(void *op_kernel, OrtKernelContext *ctx) {
  (void)op_kernel;
  const OrtValue *in[4] = {NULL, NULL, NULL, NULL};
  OrtStatus *st;
  for (size_t i = 0; i < 4; ++i)
    if ((st = g_ort->KernelContext_GetInput(ctx, i, &in[i])) != NULL) return st;
  int64_t d[8], e[8];
  size_t r = 0, re = 0;
  if ((st = ep_shape(in[0], d, &r)) != NULL) return st;
  if (r < 1) return ep_error("ScaledResidualAdd: X must have rank >= 1");
  const int64_t n = d[r - 1], m = ep_count(d, r - 1);
  if ((st = ep_shape(in[3], e, &re)) != NULL) return st;
  if (re != r || memcmp(d, e, r * sizeof(int64_t)) != 0)
    return ep_error("ScaledResidualAdd: the residual R must have X's shape");
  if ((st = ep_shape(in[1], e, &re)) != NULL) return st;
  if (ep_count(e, re) != m || (re > 0 && e[re - 1] != 1))
    return ep_error("ScaledResidualAdd: the row scale S must hold one value per row of X ([..., 1])");
  if ((st = ep_shape(in[2], e, &re)) != NULL) return st;
  if (ep_count(e, re) != n) return ep_error("ScaledResidualAdd: the bias B must hold X's last dimension");
  OrtValue *hv = NULL;
  if ((st = g_ort->KernelContext_GetOutput(ctx, 0, d, r, &hv)) != NULL) return st;
  const void *p[4] = {NULL, NULL, NULL, NULL};
  for (size_t i = 0; i < 4; ++i)
    if ((st = g_ort->GetTensorData(in[i], &p[i])) != NULL) return st;
  void *h = NULL;
  if ((st = g_ort->GetTensorMutableData(hv, &h)) != NULL) return st;
  if (m == 0 || n == 0) return NULL;
  SaWork work = {(const float *)p[0], (const float *)p[1], (const float *)p[2], (const float *)p[3], (float *)h, n};
  return ep_run_rows(ctx, sa_rows, &work, m, n, SA_PARALLEL_MIN);
}

static OrtStatus *sa_create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, void **kernel) {
  (void)op;
  (void)api;
  (void)info;
  *kernel = NULL; /* stateless */
  return NULL;
}

/* H: X's type and shape. */
static OrtStatus *sa_infer(const OrtCustomOp *op, OrtShapeInferContext *ctx) {
  (void)op;
  OrtTensorTypeAndShapeInfo *in = NULL;
  OrtStatus *st;
  if ((st = g_ort->ShapeInferContext_GetInputTypeShape(ctx, 0, &in)) != NULL) return st;
  return g_ort->ShapeInferContext_SetOutputTypeShape(ctx, 0, in); /* `in` belongs to the context */
}

/* ---------------------------------------------------------------- registration */

static void ep_destroy(void *k) { free(k); }
static const char *qr_name(const OrtCustomOp *op) { (void)op; return "QuantizeRows"; }
static const char *sa_name(const OrtCustomOp *op) { (void)op; return "ScaledResidualAdd"; }
static const char *ep_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static ONNXTensorElementDataType ep_float(const OrtCustomOp *op, size_t i) {
  (void)op; (void)i;
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static ONNXTensorElementDataType qr_out_type(const OrtCustomOp *op, size_t i) {
  (void)op;
  return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static size_t ep_one(const OrtCustomOp *op) { (void)op; return 1; }
static size_t ep_two(const OrtCustomOp *op) { (void)op; return 2; }
static size_t ep_four(const OrtCustomOp *op) { (void)op; return 4; }
static OrtCustomOpInputOutputCharacteristic ep_required(const OrtCustomOp *op, size_t i) {
  (void)op; (void)i;
  return INPUT_OUTPUT_REQUIRED;
}
static OrtMemType ep_mem(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return OrtMemTypeDefault; }
static int ep_arity(const OrtCustomOp *op) { (void)op; return 1; }
static int ep_start(const OrtCustomOp *op) { (void)op; return 1; }
static int ep_end(const OrtCustomOp *op) { (void)op; return 1 << 30; }

static OrtCustomOp g_qr, g_sa;

static void ep_common(OrtCustomOp *o) {
  memset(o, 0, sizeof(*o));
  o->version = EP_API_VERSION;
  o->GetExecutionProviderType = ep_provider;
  o->GetInputType = ep_float;
  o->KernelDestroy = ep_destroy;
  o->GetInputCharacteristic = ep_required;
  o->GetOutputCharacteristic = ep_required;
  o->GetInputMemoryType = ep_mem;
  o->GetVariadicInputMinArity = ep_arity;
  o->GetVariadicInputHomogeneity = ep_arity;
  o->GetVariadicOutputMinArity = ep_arity;
  o->GetVariadicOutputHomogeneity = ep_arity;
  o->GetStartVersion = ep_start;
  o->GetEndVersion = ep_end;
}

/* Called by RegisterCustomOps (register.c): adds QuantizeRows and ScaledResidualAdd to the "dyncompile" domain. */
OrtStatus *dc_add_int8_epilogue_ops(const OrtApi *api, OrtCustomOpDomain *domain) {
  g_ort = api;
  ep_common(&g_qr);
  g_qr.GetName = qr_name;
  g_qr.GetInputTypeCount = ep_one;
  g_qr.GetOutputType = qr_out_type;
  g_qr.GetOutputTypeCount = ep_two;
  g_qr.CreateKernelV2 = qr_create;
  g_qr.KernelComputeV2 = qr_compute;
  g_qr.InferOutputShapeFn = qr_infer;
  ep_common(&g_sa);
  g_sa.GetName = sa_name;
  g_sa.GetInputTypeCount = ep_four;
  g_sa.GetOutputType = ep_float;
  g_sa.GetOutputTypeCount = ep_one;
  g_sa.CreateKernelV2 = sa_create;
  g_sa.KernelComputeV2 = sa_compute;
  g_sa.InferOutputShapeFn = sa_infer;
  OrtStatus *st = g_ort->CustomOpDomain_Add(domain, &g_qr);
  if (st != NULL) return st;
  return g_ort->CustomOpDomain_Add(domain, &g_sa);
}
