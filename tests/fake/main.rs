//! The tests that run without a GPU, against cudrv's emulated driver (`cudrv-test-support`): one
//! binary, a module per area. Each body runs in a child process of this binary
//! (`run_with_fake`), configured through its environment.

mod api;
mod basics;
mod graph;
#[path = "../graph_cases/mod.rs"]
mod graph_cases;
mod interposer;
mod launch;
mod memory;
mod soundness;

use cudrv::Error;

/// The message of an [`Error::InvalidArgument`]; panics on any other error.
pub fn invalid_argument(e: Error) -> String {
    match e {
        Error::InvalidArgument(msg) => msg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// The kernel and reason of an [`Error::InvalidLaunch`]; panics on any other error.
pub fn invalid_launch(e: Error) -> String {
    match e {
        Error::InvalidLaunch { kernel, reason } => format!("launch of `{kernel}`: {reason}"),
        other => panic!("expected InvalidLaunch, got {other:?}"),
    }
}
mod capture_review;
