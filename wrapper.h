/* The headers that cudrv-sys runs bindgen on. The list itself is in sys/wrapper.h, inside the
 * cudrv-sys package (a published crate cannot read files outside its folder); this file only
 * includes it, so there is one list. */
#include "sys/wrapper.h"
