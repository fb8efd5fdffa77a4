//! [`PoolError`]: why the pool refused a request.

use std::fmt;

/// Errors of a stream-ordered pool's bookkeeping, before they become [`crate::Error`]s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PoolError<E> {
    /// The device is out of memory, even after the pool released what it caches and retried.
    OutOfMemory {
        /// Bytes asked for.
        requested: usize,
        /// Bytes the pool holds from the driver after releasing what it could.
        reserved: usize,
        /// Bytes of live allocations (as requested).
        in_use: usize,
    },
    /// The request is larger than the pool accepts.
    TooLarge {
        /// Bytes asked for.
        requested: usize,
    },
    /// A free of a pointer that is not a live allocation of this pool, or with another size than
    /// it was allocated with (a double free is one case). Nothing was changed.
    InvalidFree {
        /// The pointer passed.
        ptr: u64,
        /// The size passed.
        bytes: usize,
    },
    /// A driver call failed. The pool is consistent: nothing was lost or handed out twice.
    Backend(E),
}

impl<E: fmt::Display> fmt::Display for PoolError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::OutOfMemory { requested, reserved, in_use } => write!(
                f,
                "out of device memory: {requested} bytes requested, {reserved} bytes reserved by the pool, \
                 {in_use} bytes in use"
            ),
            Self::TooLarge { requested } => write!(f, "an allocation of {requested} bytes is too large"),
            Self::InvalidFree { ptr, bytes } => {
                write!(f, "{ptr:#x} with {bytes} bytes is not a live allocation of this pool")
            }
            Self::Backend(e) => write!(f, "driver call failed: {e}"),
        }
    }
}

impl<E> From<E> for PoolError<E> {
    fn from(e: E) -> Self {
        PoolError::Backend(e)
    }
}
