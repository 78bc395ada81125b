// The emulator's stand-in for CUDA's <cuda_fp16.h>: IEEE half as 16 bits with the conversions
// the kernels use, rounding to nearest with ties to even as the device's `_rn` intrinsics do.
#pragma once
#include "ava_emu_types.h"
