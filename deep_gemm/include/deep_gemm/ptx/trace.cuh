#pragma once
// Checkpoints for debugging hangs. With DG_DEBUG_TRACE defined (DG_JIT_DEBUG_TRACE=1), CTA 0
// writes progress values into host-mapped memory that the host reads while the kernel runs.
#ifdef DG_DEBUG_TRACE
__device__ unsigned int* dg_trace;
#define DG_TRACE(slot, value)                                                  \
    do {                                                                       \
        if (blockIdx.x == 0) {                                                 \
            *reinterpret_cast<volatile unsigned int*>(dg_trace + (slot)) = (value); \
            __threadfence_system();                                            \
        }                                                                      \
    } while (0)
#else
#define DG_TRACE(slot, value) do {} while (0)
#endif
