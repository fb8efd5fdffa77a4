/* The headers that cudrv-sys runs bindgen on. The driver API only: cuda.h. */
#include <cuda.h>
