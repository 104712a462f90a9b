/* dyncompile's ONNX Runtime custom-op library: the one entry point ORT calls (RegisterCustomOps), which adds every
 * operator of the "dyncompile" domain built from this folder's sources (sparse_rows.c, int8_epilogues.c).
 *
 * Built by dyncompile.runtime.kernels at first use with the system C compiler against onnxruntime_c_api.h.
 */
#include <stddef.h>

#include "onnxruntime_c_api.h"

#define DC_API_VERSION 17 /* KernelContext_ParallelFor and custom-op shape inference: ORT >= 1.17 */

OrtStatus *dc_add_sparse_rows_ops(const OrtApi *api, OrtCustomOpDomain *domain);
OrtStatus *dc_add_int8_epilogue_ops(const OrtApi *api, OrtCustomOpDomain *domain);

/* The ISA the library was compiled for must be there at load time. */
static int dc_cpu_ok(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
#if defined(__AVX2__)
  if (!__builtin_cpu_supports("avx2")) return 0;
#endif
#if defined(__FMA__)
  if (!__builtin_cpu_supports("fma")) return 0;
#endif
#endif
  return 1;
}

#if defined(_WIN32)
#define DC_EXPORT __declspec(dllexport)
#else
#define DC_EXPORT __attribute__((visibility("default")))
#endif

DC_EXPORT OrtStatus *ORT_API_CALL RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
  const OrtApi *api = base->GetApi(DC_API_VERSION);
  if (api == NULL) return NULL; /* cannot even report: ORT older than 1.17 */
  if (!dc_cpu_ok())
    return api->CreateStatus(ORT_FAIL, "dyncompile's kernel library was built for a CPU with AVX2/FMA that this "
                                       "machine lacks; delete $DYNCOMPILE_HOME/kernels and run again to rebuild it here");
  OrtCustomOpDomain *domain = NULL;
  OrtStatus *st = api->CreateCustomOpDomain("dyncompile", &domain);
  if (st != NULL) return st;
  if ((st = dc_add_sparse_rows_ops(api, domain)) != NULL) return st;
  if ((st = dc_add_int8_epilogue_ops(api, domain)) != NULL) return st;
  return api->AddCustomOpDomain(options, domain);
}
