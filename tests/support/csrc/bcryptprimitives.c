/*
 * A stand-in for Windows' bcryptprimitives.dll, for running Rust test executables under Wine 8.
 *
 * Rust's standard library (1.78 and later) imports ProcessPrng from bcryptprimitives.dll for its
 * random numbers (HashMap seeds and the like). Wine 8 has no bcryptprimitives.dll, so every Rust
 * executable fails to start there. This DLL exports ProcessPrng, implemented over
 * SystemFunction036 (RtlGenRandom) from advapi32, which Wine has. Put it beside the executables.
 *
 * Built with mingw by tests/support/build.rs for windows-gnu targets:
 *   x86_64-w64-mingw32-gcc -shared -static-libgcc bcryptprimitives.c -o bcryptprimitives.dll -ladvapi32
 */
#include <windows.h>

/* RtlGenRandom, from ntsecapi.h (declared here so that the header's macros stay out of the way). */
__declspec(dllimport) BOOLEAN WINAPI SystemFunction036(PVOID RandomBuffer, ULONG RandomBufferLength);

/* Fills pbData with cbData random bytes. Windows documents ProcessPrng as always returning TRUE;
 * this one returns FALSE if RtlGenRandom fails. */
__declspec(dllexport) BOOL WINAPI ProcessPrng(PBYTE pbData, SIZE_T cbData) {
    while (cbData > 0) {
        /* RtlGenRandom takes a ULONG length: fill in chunks. */
        ULONG chunk = cbData > 0x40000000u ? 0x40000000u : (ULONG)cbData;
        if (!SystemFunction036(pbData, chunk)) return FALSE;
        pbData += chunk;
        cbData -= chunk;
    }
    return TRUE;
}
