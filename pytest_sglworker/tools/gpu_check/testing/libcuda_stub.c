/* A stand-in libcuda.so for tests/test_gpu_check.py: the CUDA driver calls holder.py makes (RealCuda in
 * cuda_driver.py), with the real signatures, so that the ctypes marshalling of the real path is checked
 * without a GPU. One fake H200. cuMemsetD8 / cuMemFree insist on the pointer and size cuMemAlloc handed
 * out, so a wrongly passed argument fails. STUB_CUDA_FAIL=ctxcreate makes cuCtxCreate_v2 fail (the holder
 * falls back to the primary context), STUB_CUDA_FAIL=alloc makes cuMemAlloc_v2 fail with OUT_OF_MEMORY.
 *
 * Build: cc -shared -fPIC -o libcuda_stub.so libcuda_stub.c
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef struct { char bytes[16]; } CUuuid;

static int inited = 0;
static int context_object = 0;
static CUcontext current = NULL;
static CUdeviceptr allocated = 0;
static size_t allocated_size = 0;
static const size_t total = (size_t)143771 << 20;

static int failing(const char *what) {
    const char *spec = getenv("STUB_CUDA_FAIL");
    return spec != NULL && strstr(spec, what) != NULL;
}

CUresult cuInit(unsigned int flags) { if (flags != 0) return 1; inited = 1; return 0; }
CUresult cuDriverGetVersion(int *version) { *version = 13000; return 0; }
CUresult cuDeviceGetCount(int *count) { if (!inited) return 3; *count = 1; return 0; }
CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!inited) return 3;
    if (ordinal != 0) return 101;
    *device = 0;
    return 0;
}
CUresult cuDeviceGetName(char *name, int len, CUdevice device) {
    if (device != 0 || len < 8) return 1;
    snprintf(name, (size_t)len, "NVIDIA H200 (stub)");
    return 0;
}
CUresult cuDeviceGetPCIBusId(char *bus, int len, CUdevice device) {
    if (device != 0 || len < 13) return 1;
    snprintf(bus, (size_t)len, "0000:19:00.0");
    return 0;
}
CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice device) {
    if (device != 0) return 101;
    for (int i = 0; i < 16; i++) uuid->bytes[i] = (char)(0xa0 + i);
    return 0;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice device) { if (device != 0) return 101; *bytes = total; return 0; }
CUresult cuCtxCreate_v2(CUcontext *context, unsigned int flags, CUdevice device) {
    if (failing("ctxcreate")) return 801;
    if (flags != 0 || device != 0) return 1;
    *context = &context_object;
    current = *context;
    return 0;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *context, CUdevice device) {
    if (device != 0) return 101;
    *context = &context_object;
    return 0;
}
CUresult cuCtxSetCurrent(CUcontext context) { if (context != &context_object) return 201; current = context; return 0; }
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    if (current == NULL) return 201;
    *total_bytes = total;
    *free_bytes = total - ((size_t)1042 << 20) - allocated_size;
    return 0;
}
CUresult cuMemAlloc_v2(CUdeviceptr *pointer, size_t bytes) {
    if (current == NULL) return 201;
    if (failing("alloc")) return 2;
    allocated = 0x7f0000000000ULL;
    allocated_size = bytes;
    *pointer = allocated;
    return 0;
}
CUresult cuMemsetD8_v2(CUdeviceptr pointer, unsigned char value, size_t count) {
    if (current == NULL) return 201;
    return (pointer == allocated && count == allocated_size && value == 0) ? 0 : 1;
}
CUresult cuCtxSynchronize(void) { return current != NULL ? 0 : 201; }
CUresult cuMemFree_v2(CUdeviceptr pointer) {
    if (pointer != allocated || allocated == 0) return 1;
    allocated = 0;
    allocated_size = 0;
    return 0;
}
CUresult cuCtxDestroy_v2(CUcontext context) { if (context != &context_object) return 201; current = NULL; return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) { if (device != 0) return 101; current = NULL; return 0; }
CUresult cuGetErrorName(CUresult error, const char **name) {
    switch (error) {
    case 1: *name = "CUDA_ERROR_INVALID_VALUE"; return 0;
    case 2: *name = "CUDA_ERROR_OUT_OF_MEMORY"; return 0;
    case 3: *name = "CUDA_ERROR_NOT_INITIALIZED"; return 0;
    case 101: *name = "CUDA_ERROR_INVALID_DEVICE"; return 0;
    case 201: *name = "CUDA_ERROR_INVALID_CONTEXT"; return 0;
    case 801: *name = "CUDA_ERROR_NOT_SUPPORTED"; return 0;
    default: return 1;
    }
}
