// The warp policies (products per warp, mma.sync or FMA), each in its own header.
#pragma once

#include "f16.cuh"
#include "f64.cuh"
#include "simt.cuh"
#include "tf32.cuh"
