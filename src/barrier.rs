//! Asymmetric memory barriers: a cheap one for a path taken often, paired with an expensive one
//! for a rare path, so that the frequent path needs no atomic read-modify-write.
//!
//! The pattern they serve is a store followed by a load on each side (Dekker's): one thread
//! stores `a` then loads `b`, another stores `b` then loads `a`, and at least one of them must see
//! the other's store. Ordinarily both sides pay a full barrier (a locked instruction or a fence),
//! about 20 cycles on x86-64. With [`publish`] on the frequent side and [`heavy`] on the rare
//! side, the frequent side pays only a plain store and a compiler fence where the operating
//! system can make every other thread of the process execute a full fence on demand: Linux's
//! `membarrier` (`MEMBARRIER_CMD_PRIVATE_EXPEDITED`, Linux 4.14) on x86-64 and AArch64.
//! Elsewhere (other systems, a kernel or sandbox that refuses the call, Miri), and until the
//! process is registered for it, [`publish`] is an atomic swap and [`heavy`] a fence: the ordinary,
//! symmetric pattern.
//!
//! Registering takes a grace period of the kernel's (milliseconds) once the process has several
//! threads, so [`init`] leaves it to a thread of its own: no caller waits for it.
//!
//! A stream's gate ([`crate::stream`]) uses them: its owner thread enters the gate on every
//! buffer allocation and free, and a capture that begins on the stream waits for the gate.
//!
//! **Contract.** If thread A does `publish(a, ..)` then a `SeqCst` load of `b`, and thread B does
//! a `SeqCst` store (or read-modify-write) of `b`, then `heavy()`, then a `SeqCst` load of `a`, at
//! least one of the loads sees the other thread's store. Only thread A may write `a`.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering, compiler_fence, fence};

/// [`STATE`] before [`init`]: [`publish`] swaps.
const UNKNOWN: u8 = 0;
/// A thread of [`init`]'s registers the process for the system's barrier: [`publish`] swaps.
const REGISTERING: u8 = 1;
/// The process is registered: [`publish`] stores, and [`heavy`] calls the system's barrier.
const SYSTEM: u8 = 2;
/// The system's barrier is not available: [`publish`] swaps, [`heavy`] fences.
const FENCE: u8 = 3;

/// Which barriers are in use. Goes from [`UNKNOWN`] to [`SYSTEM`] or [`FENCE`] once (through
/// [`REGISTERING`]), and never back. Read and written `SeqCst`: a [`heavy`] that reads another
/// state than [`SYSTEM`] comes, in the single total order of `SeqCst` operations, before every
/// [`publish`] that reads [`SYSTEM`], whose caller's later load then sees the heavy side's store.
static STATE: AtomicU8 = AtomicU8::new(UNKNOWN);

/// Stores `value` into `slot` (which only the calling thread writes), ordered before the caller's
/// later `SeqCst` loads as the module's contract says: a plain store and a compiler fence once the
/// process is registered for the system's barrier, else an atomic swap.
#[inline]
pub(crate) fn publish(slot: &AtomicUsize, value: usize) {
    publish_in(STATE.load(Ordering::SeqCst) == SYSTEM, slot, value);
}

/// [`publish`] with the system's barrier in use or not.
#[inline]
fn publish_in(system: bool, slot: &AtomicUsize, value: usize) {
    if system {
        slot.store(value, Ordering::Relaxed);
        compiler_fence(Ordering::SeqCst);
    } else {
        slot.swap(value, Ordering::SeqCst);
    }
}

/// The expensive side: makes every thread of the process that runs now execute a full fence (the
/// system's barrier, about a microsecond) once the process is registered for it, else fences.
/// See the module's contract.
pub(crate) fn heavy() {
    heavy_in(STATE.load(Ordering::SeqCst) == SYSTEM);
}

/// [`heavy`] with the system's barrier in use or not.
fn heavy_in(system: bool) {
    fence(Ordering::SeqCst);
    if system && !system::barrier() {
        // Registered, yet every barrier refused (the expedited one again and again, then the
        // global one): a seccomp filter installed since, say. Stores already published with a
        // compiler fence only cannot be fenced after the fact, so going on could let a capture
        // begin under a gate, and stopping is the one sound answer.
        warn_line!("cudrv: the system's memory barrier (membarrier) failed after registering for it; aborting");
        std::process::abort();
    }
}

/// Starts registering the process for the system's barrier, the first time, on a thread of its
/// own (where the system has none, or the thread cannot start, the barriers stay symmetric).
/// Returns at once.
pub(crate) fn init() {
    if STATE.load(Ordering::Relaxed) != UNKNOWN
        || STATE.compare_exchange(UNKNOWN, REGISTERING, Ordering::SeqCst, Ordering::Relaxed).is_err()
    {
        return;
    }
    let register = || {
        let state = if system::register() { SYSTEM } else { FENCE };
        STATE.store(state, Ordering::SeqCst);
    };
    if !system::AVAILABLE || std::thread::Builder::new().name("cudrv-membarrier".into()).spawn(register).is_err() {
        STATE.store(FENCE, Ordering::SeqCst);
    }
}

#[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"), not(miri)))]
mod system {
    use std::ffi::{c_int, c_long};

    /// The system has a barrier to register for.
    pub(super) const AVAILABLE: bool = true;

    // SAFETY: `syscall` is libc's (std links libc on Linux), with this variadic signature.
    unsafe extern "C" {
        fn syscall(number: c_long, ...) -> c_long;
    }

    /// `__NR_membarrier`.
    #[cfg(target_arch = "x86_64")]
    const MEMBARRIER: c_long = 324;
    #[cfg(target_arch = "aarch64")]
    const MEMBARRIER: c_long = 283;

    /// `MEMBARRIER_CMD_QUERY`: the commands the kernel supports, as a bit mask.
    const CMD_QUERY: c_int = 0;
    /// `MEMBARRIER_CMD_GLOBAL` (was `MEMBARRIER_CMD_SHARED`).
    const CMD_GLOBAL: c_int = 1;
    /// `MEMBARRIER_CMD_PRIVATE_EXPEDITED`.
    const CMD_PRIVATE_EXPEDITED: c_int = 1 << 3;
    /// `MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED`.
    const CMD_REGISTER_PRIVATE_EXPEDITED: c_int = 1 << 4;

    fn membarrier(cmd: c_int) -> c_long {
        // SAFETY: membarrier(cmd, flags = 0, cpu_id = 0) reads no memory of the caller; its
        // arguments are passed as longs, as `syscall` reads them. An unknown command or a
        // refusal is an error return (-1), never undefined behaviour.
        unsafe { syscall(MEMBARRIER, c_long::from(cmd), 0 as c_long, 0 as c_long) }
    }

    /// Registers the process for expedited private barriers: whether that worked.
    pub(super) fn register() -> bool {
        let supported = membarrier(CMD_QUERY);
        let wanted = (CMD_PRIVATE_EXPEDITED | CMD_REGISTER_PRIVATE_EXPEDITED) as c_long;
        supported >= 0 && supported & wanted == wanted && membarrier(CMD_REGISTER_PRIVATE_EXPEDITED) == 0
    }

    /// A full fence on every CPU that runs a thread of this process now: whether it worked.
    /// Once registered, the expedited barrier fails only for want of kernel memory (`ENOMEM`,
    /// for its CPU mask), and is tried again a while; then the global one (every CPU, a grace
    /// period of the kernel's: milliseconds; refused on `nohz_full` kernels) serves.
    pub(super) fn barrier() -> bool {
        for _ in 0..64 {
            if membarrier(CMD_PRIVATE_EXPEDITED) == 0 {
                return true;
            }
            std::thread::yield_now();
        }
        membarrier(CMD_GLOBAL) == 0
    }
}

#[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"), not(miri))))]
mod system {
    /// No system barrier here.
    pub(super) const AVAILABLE: bool = false;

    pub(super) fn register() -> bool {
        false
    }

    pub(super) fn barrier() -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

    use super::{REGISTERING, STATE, SYSTEM, UNKNOWN};

    /// Waits until registering is done: whether the system's barrier is in use.
    fn registered() -> bool {
        super::init();
        loop {
            match STATE.load(Ordering::SeqCst) {
                UNKNOWN | REGISTERING => std::thread::yield_now(),
                state => return state == SYSTEM,
            }
        }
    }

    /// The module's contract, as a store-buffering litmus test, with the system's barrier in use
    /// or not: in no round may both threads miss the other's store. The threads meet by spinning
    /// on a round number, and each waits a different short while before its store, so that in
    /// many rounds the two stores are in flight together: with a plain store on one side and a
    /// fence only on the other, 0.2–6% of the rounds miss both on 2-core machines. (Against the
    /// system's own guarantee it is weaker: the system call's latency alone lets most stores
    /// drain.) Returns the rounds in which both missed.
    fn litmus(system: bool) -> u64 {
        let rounds: u64 = if cfg!(miri) { 40 } else { 20_000 };
        let shared = Arc::new((AtomicUsize::new(0), AtomicBool::new(false), AtomicU64::new(0), AtomicU64::new(0)));
        let light_saw = Arc::new(AtomicBool::new(false));
        let light_side = {
            let (shared, light_saw) = (shared.clone(), light_saw.clone());
            std::thread::spawn(move || {
                let (a, b, go, done) = &*shared;
                for round in 1..=rounds {
                    wait_for(go, round);
                    spin(round * 7 % 64);
                    super::publish_in(system, a, 1);
                    light_saw.store(b.load(Ordering::SeqCst), Ordering::Relaxed);
                    done.store(round, Ordering::Release);
                }
            })
        };
        let (a, b, go, done) = &*shared;
        let mut both_missed = 0;
        for round in 1..=rounds {
            go.store(round, Ordering::Release);
            spin(round * 13 % 64);
            b.store(true, Ordering::SeqCst);
            super::heavy_in(system);
            let heavy_saw = a.load(Ordering::SeqCst) != 0;
            wait_for(done, round);
            both_missed += u64::from(!heavy_saw && !light_saw.load(Ordering::Relaxed));
            a.store(0, Ordering::Relaxed);
            b.store(false, Ordering::Relaxed);
        }
        light_side.join().unwrap();
        both_missed
    }

    #[test]
    fn one_side_always_sees_the_other() {
        if !cfg!(miri) && std::thread::available_parallelism().is_ok_and(|n| n.get() < 2) {
            // Stores are reordered only between CPUs: with one, every round passes anyway.
            // (Miri, which reports one CPU, emulates the reordering of a weak memory model.)
            eprintln!("one CPU: the litmus test cannot tell anything here");
            return;
        }
        assert_eq!(litmus(false), 0, "both sides missed the other's store with the symmetric barriers");
        if registered() {
            assert_eq!(litmus(true), 0, "both sides missed the other's store with the system's barrier");
        }
    }

    /// Waits until `at` holds `value`: spins, then yields (a machine with fewer free CPUs than
    /// threads would otherwise spin for a whole time slice each round).
    fn wait_for(at: &AtomicU64, value: u64) {
        let mut spins = 0u32;
        while at.load(Ordering::Acquire) != value {
            spins += 1;
            if spins < 1_000 { std::hint::spin_loop() } else { std::thread::yield_now() }
        }
    }

    /// Spins `n` times.
    fn spin(n: u64) {
        for _ in 0..n {
            std::hint::spin_loop();
        }
    }
}
