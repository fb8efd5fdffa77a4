/* The headers that cudrv-sys runs bindgen on. The driver API only: cuda.h.
 *
 * This is the file that sys/build.rs reads, so that it ships in the cudrv-sys package; the
 * wrapper.h at the top of the workspace only includes it. */
#include <cuda.h>
